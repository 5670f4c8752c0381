"""Preprocessing handlers with the PyTorch lane's names: JSON record -> token arrays.

Why: users moving from MindSpeed-LLM pick a handler by name (``--handler-name``) and expect the
same record formats (Alpaca, ShareGPT, their pairwise variants, plain pretraining text) and the
same outputs: pretraining documents, or ``input_ids``/``attention_mask``/``labels`` with
``IGNORE_INDEX`` (-100) on every token the loss must not see (system, user, tool turns and
template scaffolding), so only assistant replies are trained.

Conversation rendering: with a tokenizer ``chat_template`` the whole conversation is rendered
once; each trained assistant reply is located in the text (plus the end-of-turn token right
after it) and the text is cut into alternating prompt / reply segments, each tokenised
separately (LLaMA-Factory's convention), so the label mask falls exactly on reply tokens.
Without a template the "empty" format is used: ``prompt + reply + eod`` per turn, no separators.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .tokenizer import Tokenizer

IGNORE_INDEX = -100
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>", "<|end_of_text|>")
_ROLE_MAP = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "system": "system", "observation": "tool", "tool": "tool", "function": "tool", "function_call": "assistant",
}


class BadSample(ValueError):
    """A record that cannot be processed; the message says why (the caller adds file:line)."""


def _get_str(obj: dict, key: str, required: bool = True) -> str:
    val = obj.get(key)
    if val is None:
        if required:
            raise BadSample(f"missing field {key!r}")
        return ""
    if not isinstance(val, str):
        raise BadSample(f"field {key!r} must be a string, got {type(val).__name__}")
    return val


class BaseHandler(ABC):
    """Handler interface: ``output_keys`` and ``process(record) -> {key: int array}`` or ``None``
    (nothing to write, e.g. an empty document). Raises ``BadSample`` for malformed records."""

    name = "BaseHandler"
    instruction = False  # True: outputs are the `_packed_` SFT trio (or pairwise keys)

    def __init__(self, tokenizer: Tokenizer, json_keys: Sequence[str] = ("text",), append_eod: bool = False,
                 seq_length: Optional[int] = None, map_keys: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.json_keys = list(json_keys)
        self.append_eod = bool(append_eod)
        self.seq_length = seq_length
        self.map_keys = dict(map_keys or {})

    @property
    @abstractmethod
    def output_keys(self) -> List[str]:
        """Names of the arrays ``process`` returns (one indexed dataset each)."""

    @abstractmethod
    def process(self, obj: Any) -> Optional[Dict[str, np.ndarray]]:
        """One record -> arrays by output key, or None to skip it."""

    def process_batch(self, objs: Sequence[Any]) -> List[Any]:
        """Per record: a result dict, ``None`` or a ``BadSample`` instance (never raises for data)."""
        out: List[Any] = []
        for o in objs:
            try:
                out.append(self.process(o))
            except BadSample as e:
                out.append(e)
        return out

    def key(self, name: str) -> str:
        return self.map_keys.get(name, name)


class GeneralPretrainHandler(BaseHandler):
    """One document per record per ``--json-keys`` entry, ``eod`` appended with ``--append-eod``."""

    name = "GeneralPretrainHandler"

    @property
    def output_keys(self) -> List[str]:
        return self.json_keys

    def _texts(self, obj: Any) -> List[str]:
        if not isinstance(obj, dict):
            raise BadSample(f"expected a JSON object, got {type(obj).__name__}")
        return [_get_str(obj, k) for k in self.json_keys]

    def process(self, obj: Any) -> Optional[Dict[str, np.ndarray]]:
        return self.process_batch([obj])[0]

    def process_batch(self, objs: Sequence[Any]) -> List[Any]:
        out: List[Any] = [None] * len(objs)
        texts, where = [], []
        for i, o in enumerate(objs):
            try:
                t = self._texts(o)
            except BadSample as e:
                out[i] = e
                continue
            texts.extend(t)
            where.append(i)
        ids = self.tokenizer.encode_batch(texts) if texts else []
        nk = len(self.json_keys)
        for j, i in enumerate(where):
            doc = {}
            for k, key in enumerate(self.json_keys):
                seq = ids[j * nk + k]
                if seq and self.append_eod:
                    seq = seq + [self.tokenizer.eod]
                doc[key] = np.asarray(seq, dtype=np.int64)
            out[i] = doc if any(len(v) for v in doc.values()) else None
        return out


# ---------------------------------------------------------------- conversations


def _segments_from_template(tok: Tokenizer, messages: List[dict], train: List[bool], tools: Optional[list]) -> List[Tuple[str, bool]]:
    """Cut the rendered conversation into contiguous ``(text, trained)`` pieces."""
    text = tok.apply_chat_template(messages, tools=tools)
    ends = tuple(t for t in ((tok.eos_token,) + _TURN_ENDS) if t)
    segs: List[Tuple[str, bool]] = []
    done = 0  # end of the last emitted segment
    search = 0  # where the next reply may start
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            # move past this message's own text so a reply that repeats it is not matched there
            p = text.find(m["content"], search) if m["content"] else -1
            search = p + len(m["content"]) if p >= 0 else search
            continue
        # The generation prompt for this turn ends exactly where the reply may begin.
        if i:
            prefix = tok.apply_chat_template(messages[:i], add_generation_prompt=True, tools=tools)
            if text.startswith(prefix):
                search = max(search, len(prefix))
        # Templates may trim the reply or drop its reasoning (Qwen3 does for turns before the last
        # query): try the reply as is, stripped, then only the answer after "</think>".
        pos, content = -1, ""
        for cand in (m["content"], m["content"].strip(), m["content"].split("</think>")[-1].strip()):
            if cand:
                pos = text.find(cand, search)
                if pos >= 0:
                    content = cand
                    break
        if pos < 0:
            raise BadSample(f"assistant turn {i} not found in the chat-template rendering")
        end = pos + len(content)
        for t in ends:  # the end-of-turn marker right after the reply is trained: the model must learn to stop
            if text.startswith(t, end):
                end += len(t)
                break
        if train[i]:
            segs.append((text[done:pos], False))
            segs.append((text[pos:end], True))
        else:
            segs.append((text[done:end], False))
        done = search = end
    if done < len(text):
        segs.append((text[done:], False))
    return segs


def conversation_to_ids(tok: Tokenizer, messages: List[dict], train_last_only: bool = False,
                        tools: Optional[list] = None, seq_length: Optional[int] = None) -> Dict[str, np.ndarray]:
    """``messages`` -> ``input_ids``/``attention_mask``/``labels`` with loss on assistant replies
    only (all of them, or only the last one with ``train_last_only``, as pairwise data needs)."""
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSample("conversation has no assistant turn")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    train = [m["role"] == "assistant" and (not train_last_only or i == last) for i, m in enumerate(messages)]
    ids: List[int] = []
    labels: List[int] = []
    if tok.chat_template:
        segs: List[Tuple[str, bool]] = []
        for s, t in _segments_from_template(tok, messages, train, tools):
            if s and segs and segs[-1][1] == t:
                segs[-1] = (segs[-1][0] + s, t)  # adjacent prompt pieces tokenise as one text
            elif s:
                segs.append((s, t))
        for (s, t), enc in zip(segs, tok.encode_batch([s for s, _ in segs])):
            ids.extend(enc)
            labels.extend(enc if t else [IGNORE_INDEX] * len(enc))
    else:
        for m, t in zip(messages, train):
            enc = tok.encode(m["content"]) if m["content"] else []
            if m["role"] == "assistant":
                enc = enc + [tok.eod]
            ids.extend(enc)
            labels.extend(enc if t else [IGNORE_INDEX] * len(enc))
    if seq_length is not None and len(ids) > seq_length:
        ids, labels = ids[:seq_length], labels[:seq_length]
    return {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "attention_mask": np.ones(len(ids), dtype=np.int64),
        "labels": np.asarray(labels, dtype=np.int64),
    }


class _InstructionBase(BaseHandler):
    instruction = True

    @property
    def output_keys(self) -> List[str]:
        return ["input_ids", "attention_mask", "labels"]

    def _tools(self, obj: dict) -> Optional[list]:
        tools = obj.get(self.key("tools"))
        if isinstance(tools, str) and tools.strip():
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError:
                raise BadSample(f"field {self.key('tools')!r} is not valid JSON") from None
        return tools or None

    @abstractmethod
    def messages(self, obj: dict) -> List[dict]:
        """The record as chat messages (``role``/``content``), per dataset style."""

    def _check(self, obj: Any) -> dict:
        if not isinstance(obj, dict):
            raise BadSample(f"expected a JSON object, got {type(obj).__name__}")
        return obj

    def process(self, obj: Any) -> Optional[Dict[str, np.ndarray]]:
        obj = self._check(obj)
        return conversation_to_ids(self.tokenizer, self.messages(obj), tools=self._tools(obj), seq_length=self.seq_length)


class AlpacaStyleInstructionHandler(_InstructionBase):
    """``{"instruction", "input", "output", "system"?, "history"?: [[q, a], ...]}``; the user turn
    is ``instruction + "\\n" + input`` (just ``instruction`` when ``input`` is empty)."""

    name = "AlpacaStyleInstructionHandler"

    def prompt_messages(self, obj: dict) -> List[dict]:
        msgs: List[dict] = []
        system = _get_str(obj, self.key("system"), required=False)
        if system:
            msgs.append({"role": "system", "content": system})
        history = obj.get(self.key("history")) or []
        if not isinstance(history, list):
            raise BadSample(f"field {self.key('history')!r} must be a list of [query, response] pairs")
        for turn in history:
            if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(x, str) for x in turn)):
                raise BadSample(f"field {self.key('history')!r} must be a list of [query, response] string pairs")
            msgs += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
        instruction = _get_str(obj, self.key("prompt") if "prompt" in self.map_keys else "instruction")
        query = _get_str(obj, self.key("query") if "query" in self.map_keys else "input", required=False)
        msgs.append({"role": "user", "content": instruction + ("\n" + query if query else "")})
        return msgs

    def messages(self, obj: dict) -> List[dict]:
        out = _get_str(obj, self.key("response") if "response" in self.map_keys else "output")
        return self.prompt_messages(obj) + [{"role": "assistant", "content": out}]


class SharegptStyleInstructionHandler(_InstructionBase):
    """``{"conversations": [{"from": "human"|"gpt"|"system"|"observation"|..., "value"}], "system"?,
    "tools"?}``; OpenAI-style ``{"role", "content"}`` entries are accepted as well."""

    name = "SharegptStyleInstructionHandler"

    def _turns(self, obj: dict, field: str) -> List[dict]:
        conv = obj.get(self.key(field))
        if conv is None and field == "conversations":
            conv = obj.get("messages")
        if not isinstance(conv, list) or not conv:
            raise BadSample(f"field {self.key(field)!r} must be a non-empty list of turns")
        return [self._turn(t, f"{self.key(field)}[{i}]") for i, t in enumerate(conv)]

    def _turn(self, t: Any, where: str) -> dict:
        if not isinstance(t, dict):
            raise BadSample(f"{where} must be an object")
        role_key = self.map_keys.get("role_tag", "from" if "from" in t else "role")
        content_key = self.map_keys.get("content_tag", "value" if "from" in t else "content")
        role, content = t.get(role_key), t.get(content_key)
        if role not in _ROLE_MAP:
            raise BadSample(f"{where} has unknown role {role!r}")
        if not isinstance(content, str):
            raise BadSample(f"{where} needs a string {content_key!r}")
        return {"role": _ROLE_MAP[role], "content": content}

    def _with_system(self, obj: dict, turns: List[dict]) -> List[dict]:
        system = _get_str(obj, self.key("system"), required=False)
        if system and not (turns and turns[0]["role"] == "system"):
            turns = [{"role": "system", "content": system}] + turns
        return turns

    def messages(self, obj: dict) -> List[dict]:
        turns = self._with_system(obj, self._turns(obj, "conversations"))
        if turns[-1]["role"] != "assistant":
            raise BadSample("conversation must end with an assistant turn")
        return turns


class _PairwiseMixin:
    instruction = True

    @property
    def output_keys(self) -> List[str]:
        return ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]

    def _reply(self, obj: dict, field: str) -> str:
        val = obj.get(self.key(field))
        if isinstance(val, dict):
            val = val.get(self.map_keys.get("content_tag", "value" if "value" in val else "content"))
        if not isinstance(val, str):
            raise BadSample(f"field {self.key(field)!r} must be a string or a turn object")
        return val

    def process(self, obj: Any) -> Optional[Dict[str, np.ndarray]]:
        obj = self._check(obj)
        prompt = self.prompt_messages(obj)
        out = {}
        for side in ("chosen", "rejected"):
            enc = conversation_to_ids(self.tokenizer, prompt + [{"role": "assistant", "content": self._reply(obj, side)}],
                                      train_last_only=True, tools=self._tools(obj), seq_length=self.seq_length)
            out[f"{side}_input_ids"] = enc["input_ids"]
            out[f"{side}_labels"] = enc["labels"]
        return out


class AlpacaStylePairwiseHandler(_PairwiseMixin, AlpacaStyleInstructionHandler):
    """``{"instruction", "input"?, "chosen", "rejected", "system"?, "history"?}`` for DPO."""

    name = "AlpacaStylePairwiseHandler"


class SharegptStylePairwiseHandler(_PairwiseMixin, SharegptStyleInstructionHandler):
    """``{"conversations": [... ending with a user turn], "chosen": {"from": "gpt", "value"},
    "rejected": {...}}`` for DPO."""

    name = "SharegptStylePairwiseHandler"

    def prompt_messages(self, obj: dict) -> List[dict]:
        turns = self._with_system(obj, self._turns(obj, "conversations"))
        if turns[-1]["role"] == "assistant":
            raise BadSample("pairwise conversation must end with a user turn")
        return turns


HANDLERS = {c.name: c for c in (GeneralPretrainHandler, AlpacaStyleInstructionHandler, SharegptStyleInstructionHandler,
                                AlpacaStylePairwiseHandler, SharegptStylePairwiseHandler)}


def build_handler(name: str, tokenizer: Tokenizer, **kwargs: Any) -> BaseHandler:
    if name not in HANDLERS:
        raise ValueError(f"--handler-name {name!r} is not one of {', '.join(HANDLERS)}")
    return HANDLERS[name](tokenizer, **kwargs)
