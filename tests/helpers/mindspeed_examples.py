"""MindSpeed-LLM's published Mcore example scripts, as the argument lists they hand to
``pretrain_gpt.py`` / ``posttrain_gpt.py`` (``tests/fixtures/mindspeed_examples.json``), and the
world size each launches (``--nproc_per_node`` x ``--nnodes`` of its launcher line,
``tests/fixtures/mindspeed_world_sizes.json``: kept apart so the argument lists stay as they are).

Refresh from a MindSpeed-LLM checkout (the commit is recorded):
    python tests/helpers/mindspeed_examples.py /path/to/MindSpeed-LLM
Each script runs in bash as written, with ``torchrun`` and ``tee`` replaced by functions that
record the arguments (also ``python -m torch.distributed.launch``), and its "your ... path"
placeholders set to the names below, so the lists are exactly what the shell would pass.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

FAMILIES = ("qwen3", "qwen3_moe", "qwen25", "llama2", "deepseek3", "glm45", "glm45-air", "qwen3_next",
            "qwen3_coder_next", "gated_deltanet", "deepseek2_lite", "kimi2")
# tests/fixtures/ (computed from this file: the module also runs as a script, see above)
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
DATA = os.path.join(FIXTURES, "mindspeed_examples.json")
WORLD = os.path.join(FIXTURES, "mindspeed_world_sizes.json")
# the folders whose world sizes are recorded: every tested one (issue #40)
WORLD_FAMILIES = FAMILIES
PLACEHOLDERS = {"CKPT_LOAD_DIR": "@LOAD@", "CKPT_SAVE_DIR": "@SAVE@", "DATA_PATH": "@DATA@",
                "TOKENIZER_PATH": "@TOKENIZER@", "TOKENIZER_MODEL": "@TOKENIZER@",
                "MASTER_ADDR": "localhost"}


def script_arguments(path: str) -> dict:
    """``{"entry": "pretrain_gpt.py", "argv": [...], "world": N}`` as bash expands ``path``'s
    launch line (``world``: its launcher's ``--nproc_per_node`` x ``--nnodes``)."""
    text = open(path, encoding="utf-8").read()
    for var, value in PLACEHOLDERS.items():
        text = re.sub(rf"^{var}=.*$", f'{var}="{value}"', text, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "argv")
        prelude = (f'torchrun() {{ printf "%s\\0" "$@" > "{out}"; }}\n'
                   'python() { torchrun "$@"; }\n'   # python -m torch.distributed.launch
                   'tee() { cat > /dev/null; }\nsource() { :; }\n')
        subprocess.run(["bash", "-c", prelude + text], cwd=tmp, check=False,
                       capture_output=True, text=True, timeout=60)
        args = open(out, encoding="utf-8").read().split("\0")[:-1]
    i = next(i for i, a in enumerate(args) if a.endswith("_gpt.py"))
    launcher = dict(zip(args[:i], args[1:i]))
    world = int(launcher.get("--nproc_per_node", 1)) * int(launcher.get("--nnodes", 1))
    return {"entry": args[i], "argv": args[i + 1:], "world": world}


def refresh(repo: str) -> None:
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    scripts = {}
    for fam in WORLD_FAMILIES:
        folder = os.path.join(repo, "examples", "mcore", fam)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".sh") and name.startswith(("pretrain_", "tune_")):
                scripts[f"{fam}/{name}"] = script_arguments(os.path.join(folder, name))
    source = f"github.com/Ascend/MindSpeed-LLM examples/mcore @ {commit}"
    lines = [f" {json.dumps(k)}: {json.dumps({'entry': v['entry'], 'argv': v['argv']})}"
             for k, v in scripts.items() if k.split("/")[0] in FAMILIES]
    with open(DATA, "w", encoding="utf-8") as f:
        f.write(f'{{"source": "{source}",\n'
                f'"scripts": {{\n' + ",\n".join(lines) + "\n}}\n")
    worlds = [f" {json.dumps(k)}: {v['world']}" for k, v in scripts.items()]
    with open(WORLD, "w", encoding="utf-8") as f:
        f.write(f'{{"source": "{source}",\n'
                f'"world_sizes": {{\n' + ",\n".join(worlds) + "\n}}\n")


def load() -> dict:
    with open(DATA, encoding="utf-8") as f:
        return json.load(f)["scripts"]


def world_sizes() -> dict:
    """Script name -> the number of ranks its launcher line starts."""
    with open(WORLD, encoding="utf-8") as f:
        return json.load(f)["world_sizes"]


if __name__ == "__main__":
    refresh(sys.argv[1])
