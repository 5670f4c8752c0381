"""docs/reference/environment.md: every environment variable ms-llm reads or sets. The
``MS_LLM_*`` ones come from their one table in the package (``ms_llm.compat.environment``: the
deprecated aliases of run-config keys, and the variables that stay variables); the variables
other programs define (msrun, the system, the launch scripts) are listed below, and
``tests/docs/test_reference_docs.py`` checks that every one the sources read is."""
from typing import Dict, Tuple

from .config_page import sections, value_text
from .markdown import code, page, table
from .schema_source import field_notes

INTRO = """Behaviour is set by the run config ([config.md](config.md)); environment variables only
say how a process is launched, where caches go, or hook into tests. The run settings that used
to be `MS_LLM_*` variables are config keys now: their variable is still read, as a deprecated
alias, when the key is not set in the config (a warning names the key)."""

# Variables other programs define that ms_llm reads or sets: name -> (who sets it, meaning).
EXTERNAL: Dict[str, Tuple[str, str]] = {
    "MS_ROLE": ("msrun", "the process's role in the cluster; present means launched by msrun, "
                         "MS_SCHED is the scheduler process (it serves the cluster, then exits "
                         "without training)"),
    "MS_WORKER_NUM": ("msrun", "the job's worker count: divides the CPUs among BLAS kernel "
                               "threads, and gives pretrain_gpt.py Megatron's default global "
                               "batch (micro batch x data-parallel size); default 1"),
    "RANK_SIZE": ("the user", "more than 1 without msrun is refused (start multi-process jobs "
                              "with scripts/pretrain.sh or msrun)"),
    "RANK_ID": ("msrun", "this process's rank: pretrain_gpt.py prints its no-op notes on rank 0 "
                         "only (else MS_NODE_ID)"),
    "MS_NODE_ID": ("msrun", "this process's node id, when RANK_ID is not set"),
    "CXX": ("the user", "C++ compiler of the CPU kernels when MS_LLM_CXX is not set (else g++)"),
    "OPENBLAS_NUM_THREADS": ("the user", "BLAS kernel threads when runtime.blas_threads is "
                                         "not set (else the CPUs divided by MS_WORKER_NUM)"),
    "ASCEND_TOOLKIT_HOME": ("CANN's set_env.sh", "where the CANN toolkit is: ms-llm qualify "
                                                 "records its version (else ASCEND_HOME_PATH, "
                                                 "then /usr/local/Ascend/ascend-toolkit/latest)"),
    "ASCEND_HOME_PATH": ("CANN's set_env.sh", "as ASCEND_TOOLKIT_HOME"),
    "TOKENIZERS_PARALLELISM": ("ms-llm preprocess", "set to false while its worker processes "
                                                    "tokenize (parallelism comes from --workers); "
                                                    "restored afterwards"),
    "HCCL_DETERMINISTIC": ("training.deterministic", "set to true (unless already set) for "
                                                     "deterministic collectives on Ascend"),
}

# Variables of the launch scripts: name -> (script, default, meaning).
SCRIPTS: Dict[str, Tuple[str, str, str]] = {
    "NPROC": ("scripts/pretrain.sh", "1", "workers on this machine (one node)"),
    "NNODES": ("scripts/pretrain.sh", "1", "nodes in the job (MindSpeed's name)"),
    "NODE_RANK": ("scripts/pretrain.sh", "0", "this node's index, 0 .. NNODES-1 (node 0 hosts "
                                              "the scheduler)"),
    "NPUS_PER_NODE": ("scripts/pretrain.sh", "NPROC", "workers per node (MindSpeed's name)"),
    "MASTER_ADDR": ("scripts/pretrain.sh", "127.0.0.1", "address of node 0; required when "
                                                         "NNODES > 1"),
    "MASTER_PORT": ("scripts/pretrain.sh", "8118", "the scheduler's port; relaunch k uses "
                                                   "MASTER_PORT + k"),
    "LOG_DIR": ("scripts/pretrain.sh", "outputs/msrun_logs", "msrun's worker logs; relaunch k "
                                                             "logs to LOG_DIR/restart_k"),
    "CLUSTER_TIME_OUT": ("scripts/pretrain.sh", "120", "seconds msrun waits for a lost worker or "
                                                       "a missing node"),
    "MAX_RESTARTS": ("scripts/pretrain.sh", "training.max_restarts",
                     "relaunch a failed job this often with --training.resume auto (needs "
                     "checkpoint.save_dir)"),
    "GLOG_v": ("scripts/pretrain.sh", "3", "MindSpore's C++ log level (3: errors only)"),
    "PYTHON": ("both scripts", "python3 on PATH", "the interpreter that has ms_llm installed"),
    "MODEL_TYPE_HF": ("scripts/convert_ckpt.sh", "qwen3", "the Hugging Face model type "
                                                          "(--model-type-hf)"),
    "TP": ("scripts/convert_ckpt.sh", "2", "target tensor-parallel size"),
    "PP": ("scripts/convert_ckpt.sh", "1", "target pipeline-parallel size"),
    "EP": ("scripts/convert_ckpt.sh", "1", "target expert-parallel size"),
}


def _reads(setting) -> str:
    """How the variable's text becomes the key's value: for a switch, what 1 and 0 give."""
    if not isinstance(setting.from_env("1"), bool):   # a switch may default to null
        return "the key's value"
    return ", ".join(f"{code(v)}: {code(value_text(setting.from_env(v)))}" for v in ("1", "0"))


def _setting_rows():
    from ms_llm.compat.environment import SETTINGS
    classes = dict(sections())
    rows = []
    for key, s in sorted(SETTINGS.items(), key=lambda item: item[1].alias):
        section, name = key.split(".")
        meaning = field_notes(classes[section]).get(name, "").replace(f" ({s.alias})", "")
        rows.append([code(s.alias), f"[{code(key)}](config.md#{section})", _reads(s),
                     code(value_text(s.default)), meaning])
    return rows


def render() -> str:
    from ms_llm.compat.environment import VARIABLES
    settings = table(["variable", "deprecated alias of", "read as", "key's default", "meaning"],
                     _setting_rows())
    variables = table(["variable", "meaning"],
                      [[code(name), VARIABLES[name]] for name in sorted(VARIABLES)])
    external = table(["variable", "set by", "meaning"],
                     [[code(name), who, what] for name, (who, what) in sorted(EXTERNAL.items())])
    scripts = table(["variable", "read by", "default", "meaning"],
                    [[code(name), script, code(default), what]
                     for name, (script, default, what) in sorted(SCRIPTS.items())])
    return page(
        "Environment variables", INTRO,
        "## Run settings (deprecated variables)\n\nSet the config key instead; the variable is "
        "read only when the key is not set.", settings,
        "## ms-llm's variables\n\nNone of them changes what a run computes.", variables,
        "## Set by other programs\n\nVariables of msrun, CANN or the user that ms-llm reads, "
        "and the ones it sets for libraries.", external,
        "## Launch scripts\n\n`scripts/pretrain.sh` (msrun) and `scripts/convert_ckpt.sh`.",
        scripts)
