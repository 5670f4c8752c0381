"""Prompts and answer extraction of the MindSpeed tasks (plain text, no model: unit-testable).

The formats follow MindSpeed-LLM's evaluation classes: MMLU's "The following are multiple
choice questions (with answers) about {subject}." header with ``A. ...`` choices and
``Answer:``; C-Eval's Chinese header with ``答案：``; BoolQ's ``{passage}\\nQuestion:
{question}?\\nAnswer:``; GSM8K's chain-of-thought ``Let's think step by step`` shots ending in
``The answer is N``. MindSpeed ships its few-shot examples as fixed JSON files; here they come
from the benchmark's own ``dev`` / ``train`` files (``--num-fewshot``), so no benchmark text is
bundled.
"""
from __future__ import annotations

import re
from typing import List, Optional, Sequence

from .formats import CHOICES, Sample

MMLU_HEADER = "The following are multiple choice questions (with answers) about {subject}.\n\n"
CEVAL_HEADER = "以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。\n\n"
GSM8K_STOP = ("Question:",)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the earliest occurrence of any stop string."""
    end = len(text)
    for s in stop:
        if s:
            k = text.find(s)
            if k != -1:
                end = min(end, k)
    return text[:end]


def _mc_block(row: dict, answer_word: str) -> str:
    return row["question"] + "".join(f"\n{c}. {row[c]}" for c in CHOICES) + f"\n{answer_word}"


def multiple_choice_prompt(sample: Sample, language: str = "en") -> str:
    """MMLU (``en``) / C-Eval (``zh``): header, shots each followed by their answer letter, the
    question and the answer cue (no trailing space: the letter's token carries it)."""
    header, word, sep = ((MMLU_HEADER, "Answer:", " ") if language == "en"
                         else (CEVAL_HEADER, "答案：", ""))
    subject = sample.subject.replace("_", " ")
    shots = "".join(_mc_block(s, word) + sep + s["answer"] + "\n\n" for s in sample.shots)
    return header.format(subject=subject) + shots + _mc_block(sample.fields, word)


def choice_continuations(language: str = "en") -> List[str]:
    """What ``mmlu_ppl`` scores after the prompt: `` A`` ... (``A`` ... for C-Eval)."""
    return [(" " if language == "en" else "") + c for c in CHOICES]


def extract_choice(text: str) -> str:
    """MindSpeed's MMLU reading of a generated answer: the letter before a ``.`` on the first
    line, else a leading letter; ``""`` if neither."""
    text = text.lstrip()
    m = re.match(r".*([ABCD])\..*", text) or re.match(r"([ABCD])", text)
    return m.group(1) if m else ""


def boolq_prompt(sample: Sample) -> str:
    row = sample.fields
    return f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:"


def _gsm8k_shot(row: dict) -> str:
    reasoning, _, _ = row["answer"].partition("####")
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()   # GSM8K's calculator notes
    from .formats import gsm8k_gold
    return (f"Question: {row['question']}\nLet's think step by step\nAnswer:\n{reasoning}\n"
            f"The answer is {gsm8k_gold(row['answer'])}\n\n")


def gsm8k_prompt(sample: Sample) -> str:
    return ("".join(_gsm8k_shot(s) for s in sample.shots)
            + f"Question: {sample.fields['question']}\nLet's think step by step\nAnswer:")


def extract_last_number(text: str) -> str:
    """MindSpeed's GSM8K reading: the last number of the reply before any ``Question:``
    (commas removed), ``"NULL"`` if there is none."""
    text = text.split("Question:")[0].replace(",", "")
    numbers = re.findall(r"-?\d+\.\d+|-?\d+", text)
    return numbers[-1] if numbers else "NULL"


def same_number(pred: str, gold: str) -> bool:
    """``12`` equals ``12.0``; anything unparsable only equals itself."""
    try:
        return float(pred) == float(gold)
    except ValueError:
        return pred == gold


def human_eval_prompt(sample: Sample, template: Optional[str] = None) -> str:
    """The problem's prompt as is (the original HumanEval completion setting), or inside
    ``--instruction-template`` (its ``{prompt}``) for instruction-tuned models."""
    return template.format(prompt=sample.fields["prompt"]) if template else sample.fields["prompt"]
