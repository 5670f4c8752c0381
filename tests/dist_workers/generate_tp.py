"""Worker for tests/inference/test_inference_tp.py, run under msrun: ``generate`` on a model sharded
by
tensor parallel over every process (argv: OUT_JSON HF_FOLDER PROMPTS_JSON).

Every rank loads the full HF folder, ``apply_tensor_parallel`` keeps its shard (the attention
reads its local query groups from ``linear_qkv``'s width, so each rank's KV cache holds only its
groups) and all ranks decode together; rank 0 writes the tokens.
"""
import json
import sys

from ms_llm.compat import setup_device

setup_device("CPU", synchronize=True)
from ms_llm.inference import generate  # noqa: E402
from ms_llm.checkpoint import from_pretrained  # noqa: E402
from ms_llm.parallel.parallelize import describe_layouts  # noqa: E402
from ms_llm.parallel.runtime import init_distributed  # noqa: E402
from ms_llm.parallel.state import initialize_model_parallel  # noqa: E402
from ms_llm.parallel.tensor_parallel import apply_tensor_parallel  # noqa: E402

info = init_distributed()
out_path, folder, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
pstate = initialize_model_parallel(tp=info.world_size)
model = from_pretrained(folder)
describe_layouts(model)          # the [gate; up] halves of linear_fc1 split per half
apply_tensor_parallel(model, pstate.group("tp"))
result = {
    "greedy": generate(model, prompts, 8, pad_token_id=0).tolist(),
    "recompute": generate(model, prompts, 8, pad_token_id=0, use_cache=False).tolist(),
    "sampled": generate(model, prompts, 8, do_sample=True, temperature=1.2, top_k=20, top_p=0.9,
                        seed=5, pad_token_id=0).tolist(),
}
if info.rank == 0:
    with open(out_path, "w") as f:
        json.dump(result, f)
print("generate_tp done", flush=True)
