"""The DeepSeek-V3 proxy (MLA, group-limited sigmoid routing with expert bias and sequence aux
loss, shared experts, a dense first layer) trains under real msrun exactly as in one process:
ep=2 with the all-to-all and the MegaMoE dispatchers, fsdp=2 (with an MTP depth: the
embedding and head it reads again stay gathered in the root), pp=2 (layers 1 | 2, the MTP depth
on the last stage with its copy of the embedding), dp=2 with
multi-token prediction (the shared embedding and head get both paths' gradients), and tp=2
(MLA heads split, with an MTP depth whose transformer layer splits likewise; a dense-MLP
variant with ``linear_q_proj``, since MoE with tensor parallel is not built), and tp=2 with
sequence parallel (the q / kv down-projections, with ``q_lora_rank``, on the gathered
sequence; the MTP block on sequence shards). The MTP runs also compare the logged
``mtp_1_loss``.

Tolerance: rtol 1e-5 on loss and grad norm over 5 AdamW steps (fp32): the parallel runs sum the
same terms in another order (all-reduce, sharded matmuls), ~1e-7 relative per step; a wrong
split or a missing gradient all-reduce changes them at 1e-3 or more."""
import numpy as np
import pytest

from helpers.deepseek_parallel_common import DENSE_MLA, DS_BASE, DS_CONFIG
from helpers.msrun import run_spec, run_worker_job
from helpers.parallel_common import run_record

from ms_llm.config import load_config
from ms_llm.training.trainer import Trainer

RTOL = 1e-5
Q_PROJ = ["--model.q_lora_rank", "null"]
MTP = ["--model.mtp_num_layers", "1"]


def spec(name, *args):
    return run_spec(name, *args, flags=["@deepseek"])


@pytest.mark.msrun
def test_proxy_ep2_megamoe_fsdp2_tp2_match_one_process(tmp_path):
    ref_moe = run_record(Trainer(load_config(DS_CONFIG, DS_BASE)))
    ref_dense = run_record(Trainer(load_config(DS_CONFIG, DS_BASE + DENSE_MLA + Q_PROJ + MTP)))
    ref_mtp = run_record(Trainer(load_config(DS_CONFIG, DS_BASE + MTP)))
    ref_dense_q = run_record(Trainer(load_config(DS_CONFIG, DS_BASE + DENSE_MLA + MTP)))
    res = run_worker_job("train_parallel.py", tmp_path, 2, [
        spec("ep2", ["--parallel.expert_model_parallel_size", "2"]),
        spec("ep2_megamoe", ["--parallel.expert_model_parallel_size", "2",
                             "--moe.dispatcher", "megamoe"]),
        spec("fsdp2_mtp", MTP, ["--parallel.fsdp_size", "2"]),
        spec("tp2", DENSE_MLA, Q_PROJ, MTP, ["--parallel.tensor_model_parallel_size", "2"]),
        spec("dp2_mtp", MTP),
        spec("tp2_sp", DENSE_MLA, MTP, ["--parallel.tensor_model_parallel_size", "2",
                                        "--parallel.sequence_parallel", "true"]),
        spec("pp2_mtp", MTP, ["--parallel.pipeline_model_parallel_size", "2",
                              "--parallel.num_layer_list", "1,2"]),
    ], timeout=900)
    for name, ref in (("ep2", ref_moe), ("ep2_megamoe", ref_moe), ("fsdp2_mtp", ref_mtp),
                      ("tp2", ref_dense), ("pp2_mtp", ref_mtp), ("dp2_mtp", ref_mtp),
                      ("tp2_sp", ref_dense_q)):
        run = res[name]
        assert len(run["loss"]) == 5, name
        np.testing.assert_allclose(run["loss"], ref["loss"], rtol=RTOL, err_msg=name)
        np.testing.assert_allclose(run["grad_norm"], ref["grad_norm"], rtol=RTOL, err_msg=name)
        assert ("mtp_1_loss" in run) == ("mtp_1_loss" in ref), name
        if "mtp_1_loss" in ref:
            np.testing.assert_allclose(run["mtp_1_loss"], ref["mtp_1_loss"], rtol=RTOL,
                                       err_msg=name)
