"""``ms-llm evaluate`` on tiny files of every format (MMLU, C-Eval, BoolQ, GSM8K, HumanEval),
against an independent computation: transformers' model of the same folder, prompts written
out here from MindSpeed's formats, greedy decoding by full recomputation in torch, and the
answer rules restated here. Each task's per-question predictions and its accuracy must equal
the reference's. The reference golds are set from the reference predictions on even rows (and
to another answer on odd rows), so accuracies are not a trivial 0.

Tolerances: predictions are argmaxes / comparisons of fp32 logits that agree with torch to
~1e-6; the fixture's random model has no near-ties at that scale (a tie would show as one
differing prediction, named in the failure)."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import eval_fixtures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 8


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from tokenizers import Tokenizer
    torch.set_num_threads(1)     # a 64-wide model: threads only spin-wait on a shared machine
    folder = eval_fixtures.make_model(str(tmp_path_factory.mktemp("eval_model")))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return folder, model, Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


def _ll(model, ctx, cont):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)
    return sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def _greedy(model, tok, text, stop=()):
    ids, eos = tok.encode(text).ids, tok.token_to_id(eval_fixtures.EOS)
    new = []
    with torch.no_grad():
        for _ in range(NEW):
            t = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if t == eos:
                break
            new.append(t)
    out = tok.decode(new)
    for s in stop:
        out = out.split(s)[0]
    return out


def _mc_prompt(row, subject, shots, zh):
    header = (f"以下是中国关于{subject.replace('_', ' ')}考试的单项选择题，请选出其中的正确答案。\n\n"
              if zh else f"The following are multiple choice questions (with answers) about "
                         f"{subject.replace('_', ' ')}.\n\n")
    cue = "\n答案：" if zh else "\nAnswer:"

    def block(r):
        return f"{r[0]}\nA. {r[1]}\nB. {r[2]}\nC. {r[3]}\nD. {r[4]}{cue}"
    return header + "".join(block(s) + ("" if zh else " ") + s[5] + "\n\n" for s in shots) \
        + block(row)


def _read(path, header):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return (rows[0], [r[1:7] for r in rows[1:]]) if header else (None, rows)


def _set_golds(path, header, preds):
    """Rewrite the answer column: the prediction on even rows, another letter on odd ones."""
    head, rows = _read(path, header)
    golds = []
    for i, (r, p) in enumerate(zip(rows, preds)):
        g = p if (i % 2 == 0 and p) else ("B" if p == "A" else "A")
        golds.append(g)
    with open(path, newline="") as f:
        full = list(csv.reader(f))
    body = full[1:] if header else full
    for r, g in zip(body, golds):
        r[6 if header else 5] = g
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(([head] if header else []) + body)
    return golds


def _choice(text):
    text = text.lstrip()
    m = re.match(r".*([ABCD])\..*", text) or re.match(r"([ABCD])", text)
    return m.group(1) if m else ""


def _mc_expected(root, split, model, tok, zh, ppl=False):
    header = zh
    exp = {}
    for name in sorted(os.listdir(os.path.join(root, split))):
        subject = re.sub(r"(?:_test|_val|_dev)?\.\w+$", "", name)
        _, shots = _read(os.path.join(root, "dev", f"{subject}_dev.csv"), header)
        _, rows = _read(os.path.join(root, split, name), header)
        preds = []
        for r in rows:
            prompt = _mc_prompt(r, subject, shots, zh)
            if ppl:
                ctx = tok.encode(prompt).ids
                lls = [_ll(model, ctx, tok.encode(" " + c).ids) for c in "ABCD"]
                preds.append("ABCD"[int(np.argmax(lls))])
            else:
                preds.append(_choice(_greedy(model, tok, prompt)))
        golds = _set_golds(os.path.join(root, split, name), header, preds)
        exp[subject] = [(p, p == g) for p, g in zip(preds, golds)]
    return exp


def _records(result, task):
    out = {}
    for r in result[task]["records"]:
        out.setdefault(r["subject"], []).append((r["prediction"], r["correct"]))
    return out


def _acc(exp):
    flat = [c for rows in exp.values() for _, c in rows]
    return sum(flat) / len(flat)


def test_every_format_matches_the_reference(ref, tmp_path):
    folder, model, tok = ref
    mmlu = eval_fixtures.write_mmlu(str(tmp_path / "mmlu"))
    ppl_root = tmp_path / "mmlu_ppl"
    ppl = eval_fixtures.write_mmlu(str(ppl_root))
    ceval = eval_fixtures.write_mmlu(str(tmp_path / "ceval"), header=True)
    boolq = eval_fixtures.write_boolq(str(tmp_path / "boolq"))
    gsm8k = eval_fixtures.write_gsm8k(str(tmp_path / "gsm8k"))
    human = eval_fixtures.write_human_eval(str(tmp_path / "he"))
    expected = {
        "mmlu": _mc_expected(str(tmp_path / "mmlu"), "test", model, tok, zh=False),
        "mmlu_ppl": _mc_expected(str(ppl_root), "test", model, tok, zh=False, ppl=True),
        "ceval": _mc_expected(str(tmp_path / "ceval"), "val", model, tok, zh=True),
    }
    # BoolQ: Yes's token against No's after the MindSpeed prompt
    rows = [json.loads(line) for line in open(os.path.join(boolq, "dev.jsonl"))]
    yes, no = tok.encode("Yes").ids[-1], tok.encode("No").ids[-1]
    bq = []
    for r in rows:
        ctx = tok.encode(f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:").ids
        pred = "T" if _ll(model, ctx, [yes]) >= _ll(model, ctx, [no]) else "F"
        bq.append((pred, pred == ("T" if r["answer"] else "F")))
    expected["boolq"] = {"dev": bq}
    # GSM8K: two chain-of-thought shots from train.jsonl, the last number before "Question:"
    shots = [json.loads(line) for line in open(os.path.join(gsm8k, "train.jsonl"))]
    shot_text = "".join(
        f"Question: {s['question']}\nLet's think step by step\nAnswer:\n"
        f"{re.sub(r'<<[^>]*>>', '', s['answer'].split('####')[0]).strip()}\n"
        f"The answer is {s['answer'].split('####')[-1].strip()}\n\n" for s in shots)
    gs = []
    test_rows = [json.loads(line) for line in open(os.path.join(gsm8k, "test.jsonl"))]
    for i, r in enumerate(test_rows):
        reply = _greedy(model, tok, shot_text + f"Question: {r['question']}\nLet's think step "
                                                "by step\nAnswer:", stop=("Question:",))
        nums = re.findall(r"-?\d+\.\d+|-?\d+", reply.replace(",", ""))
        pred = nums[-1] if nums else "NULL"
        if i % 2 == 0 and nums:        # make even rows right
            r["answer"] = f"so\n#### {pred}"
        gs.append((pred, nums != [] and float(pred) == float(r["answer"].split("####")[-1])))
    eval_fixtures.write_jsonl(os.path.join(gsm8k, "test.jsonl"), test_rows)
    expected["gsm8k"] = {"test": gs}
    # HumanEval: the completion cut at the stop lines, run here with a plain subprocess
    he = []
    for p in eval_fixtures.HUMAN_EVAL:
        completion = _greedy(model, tok, p["prompt"],
                             stop=("\nclass", "\ndef", "\n#", "\nif", "\nprint"))
        prog = p["prompt"] + completion + "\n\n" + p["test"] + f"\n\ncheck({p['entry_point']})\n"
        try:
            ok = subprocess.run([sys.executable, "-c", prog], capture_output=True,
                                timeout=3).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        he.append((completion, ok))
    expected["human_eval"] = {"HumanEval": he}

    from ms_llm.cli.evaluate import main
    out_json = tmp_path / "out.json"
    tasks = ["mmlu", "mmlu_ppl", "ceval", "boolq", "gsm8k", "human_eval"]
    code = main(["--task", *tasks, "--task-data-path", mmlu, ppl, ceval, boolq, gsm8k, human,
                 "--load", folder, "--evaluation-batch-size", "2", "--max-new-tokens", str(NEW),
                 "--human-eval-timeout", "3", "--output-json", str(out_json)])
    assert code == 0
    result = json.loads(out_json.read_text())
    for task in tasks:
        assert _records(result, task) == {k: [tuple(x) for x in v]
                                          for k, v in expected[task].items()}, task
        assert result[task]["total"]["acc"] == pytest.approx(_acc(expected[task])), task
    assert [c for _, c in he] == [True, False, False]
    assert 0 < result["mmlu_ppl"]["total"]["acc"] < 1 and 0 < result["boolq"]["total"]["acc"] < 1


def test_bad_input_is_one_line(tmp_path, capsys):
    from ms_llm.cli.evaluate import main
    bad = tmp_path / "mmlu" / "test"
    bad.mkdir(parents=True)
    (bad / "x_test.csv").write_text("q,a,b,c,d,E\n")
    assert main(["--task", "mmlu", "--task-data-path", str(bad), "--load", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "x_test.csv:1" in err[0] and "'E'" in err[0]
    assert main(["--task", "bbh", "--task-data-path", str(bad), "--load", str(tmp_path)]) == 2
    assert "not built" in capsys.readouterr().err


def test_megatron_folder_scores_like_its_hf_source(ref, tmp_path):
    """A Megatron folder converted with a padded vocabulary (320 -> 384 rows) and the HF
    tokenizer beside it: the same log-likelihood predictions as the HF folder (the padding rows
    stay out of the softmax)."""
    folder = ref[0]
    from ms_llm.checkpoint.convert import main as convert
    mg = str(tmp_path / "mg")
    assert convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", folder,
                    "--save-dir", mg, "--make-vocab-size-divisible-by", "128"]) == 0
    from ms_llm.cli.evaluate import main
    ppl = eval_fixtures.write_mmlu(str(tmp_path / "mmlu"))
    boolq = eval_fixtures.write_boolq(str(tmp_path / "boolq"))
    results = []
    for load in (folder, mg):
        out = tmp_path / f"{os.path.basename(load)}.json"
        assert main(["--task", "mmlu_ppl", "boolq", "--task-data-path", ppl, boolq, "--load", load,
                     "--tokenizer-name-or-path", folder, "--output-json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    for task in ("mmlu_ppl", "boolq"):
        assert results[0][task]["records"] == results[1][task]["records"], task
    # the values too (a shared normaliser would not change the predictions above)
    from ms_llm.evaluation.scorer import ModelScorer
    hf, meg = ModelScorer.from_path(folder), ModelScorer.from_path(mg, tokenizer=folder)
    assert meg.model.config.padded_vocab_size == 384 and meg.vocab_size == 320
    pairs = [(hf.encode("Question: what is"), hf.encode(" 42 Yes"))]
    assert hf.loglikelihood(pairs)[0][0] == pytest.approx(meg.loglikelihood(pairs)[0][0],
                                                          abs=1e-5)


def test_chunked_generation_equals_one_pass(ref):
    """Decoding in chunks that continue one KV cache (so a batch can stop at its stop strings)
    gives what one uninterrupted ``generate`` gives, for left-padded prompts of different
    lengths; stop strings cut the text and EOS ends it."""
    from ms_llm.evaluation.scorer import ModelScorer
    from ms_llm.inference import generate
    scorer = ModelScorer.from_path(ref[0])
    prompts = [scorer.encode("Question: Let's think step by step"), scorer.encode("A B"),
               scorer.encode("def f(x):\n    return")]
    chunked = scorer.generate(prompts, 10, chunk=3)
    whole = generate(scorer.model, prompts, 10, eos_token_id=scorer.eos_token_ids)
    s = whole.shape[1] - 10
    want = []
    for row in whole[:, s:]:
        ids = []
        for t in row:
            if int(t) in scorer.eos_token_ids:
                break
            ids.append(int(t))
        want.append(scorer.decode(ids))
    assert chunked == want
    stop = want[0][2:4]
    assert scorer.generate(prompts[:1], 10, stop=[stop], chunk=3) == [want[0].split(stop)[0]]
