"""A real model: transformers on cuda or cpu, embedding or generation.

- embed: AutoModel, mean pooling over the attention mask, L2 normalised
  (the sentence-transformers recipe MiniLM was trained for).
- generate: AutoModelForCausalLM, greedy decoding over a running set
  (`decoding`): rows leave as they finish (EOS, unless the request set
  `ignore_eos`, or their own `max_new_tokens`, default 32); with `batching = "iteration"` new requests
  join between decode steps (`iteration`). Sampling parameters are accepted
  on the wire but decoding is greedy, so results are reproducible.

Inputs are never truncated: `check()` refuses an input longer than
`max_input_tokens` (or than the model's position table), and token ids
outside the vocabulary. Texts are tokenized once: the ids `check()`/`measure()`
computed are kept and reused by `run()`; texts not seen before are tokenized
in one batch call. Client-supplied `token_ids` are used as given (add any
special tokens yourself).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec

from pipeline.core.config import ModelConfig
from schemas.messages import Request

from .base import MemoryKind, Output, process_rss
from .decoding import RunningSet, Sequence, decode_all
from .gguf_cache import convert_once
from .model_source import ModelSource, resolve_model_source

if TYPE_CHECKING:
    import torch

    from .iteration import IterationScheduler

Task = Literal["embed", "generate"]
_DEFAULT_NEW_TOKENS: Final = 32


class EncodingCache:
    """Token ids computed by check()/measure(), kept until run() takes them.

    Keyed by request id and validated by the text's length and hash (the text
    itself is not kept alive). Bounded by entries and by total tokens, so
    requests that are checked but never run (expired, forwarded) cannot grow it.
    """

    def __init__(self, max_entries: int = 65_536, max_tokens: int = 2_000_000) -> None:
        self._entries: OrderedDict[str, tuple[int, int, list[int]]] = OrderedDict()
        self._tokens = 0
        self._max_entries = max_entries
        self._max_tokens = max_tokens
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request_id: str, text: str, ids: list[int]) -> None:
        with self._lock:
            old = self._entries.pop(request_id, None)
            if old is not None:
                self._tokens -= len(old[2])
            self._entries[request_id] = (len(text), hash(text), ids)
            self._tokens += len(ids)
            while self._entries and (len(self._entries) > self._max_entries or self._tokens > self._max_tokens):
                self._tokens -= len(self._entries.popitem(last=False)[1][2])

    def get(self, request_id: str, text: str, *, take: bool = False) -> list[int] | None:
        with self._lock:
            hit = self._entries.pop(request_id, None) if take else self._entries.get(request_id)
            if hit is not None and take:
                self._tokens -= len(hit[2])
        if hit is None or hit[0] != len(text) or hit[1] != hash(text):
            return None
        return hit[2]


def detect_task(config: Any) -> Task:
    """Generation for causal LMs, embeddings for encoders, decided from the HF config."""
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "generate"
    if architectures:
        return "embed"
    if getattr(config, "is_decoder", False):
        return "generate"
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return "embed" if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else "generate"


def pick_device(setting: str) -> str:
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def pick_dtype(device: str) -> torch.dtype:
    """bf16 on GPUs that have it, fp16 on older ones, fp32 on CPU (half is slow there)."""
    import torch

    if not device.startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def stop_token_ids(hf_config: Any, generation_config: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids the model was trained to end on: its generation config first, then its config,
    then the tokenizer (a GGUF tokenizer's eos can be wrong: SmolLM2's says <|im_start|>)."""
    for source in (generation_config, hf_config):
        found = getattr(source, "eos_token_id", None) if source is not None else None
        if found is not None:
            return frozenset(found if isinstance(found, list) else [found])
    eos = tokenizer.eos_token_id
    return frozenset() if eos is None else frozenset([eos])


class TransformersRunner:
    """Runs a transformers model; not simulated."""

    simulated = False

    def __init__(self, model: ModelConfig, *, weights: bool = True) -> None:
        self.name = model.name
        self.weights = weights
        """False: tokenizer and limits only (a `ProcessRunner`'s front; `run()` is not available)."""
        self.config = model
        self.task: Task | None = None if model.task == "auto" else model.task
        self.device: str | None = None
        self.source: ModelSource | None = None
        self.max_input_tokens = model.max_input_tokens
        self._model: Any = None
        self._tokenizer: Any = None
        self._loaded = False
        self._vocab_size = 0
        self._pad_id = 0
        self._stop_ids: frozenset[int] = frozenset()
        self._positions: int | None = None
        cap = model.profile.hard_cap
        self._token_cap = cap if model.profile.cost_unit == "tokens" and isinstance(cap, int) else None
        """In the tokens unit no batch may exceed hard_cap tokens: a request over it never runs
        (the recommended and `auto` caps hold the longest request the model admits). A cap still
        `auto` (a config the consumer has not resolved against its engine) bounds nothing here. The
        iteration-level running set holds max_inflight_batches less the joiners' slots of
        target_size, and at least one of hard_cap."""
        self.iteration: IterationScheduler | None = None
        """The iteration-level scheduler (`batching = "iteration"`), started by load()."""
        self._encoded = EncodingCache()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        """HF fast tokenizers reset truncation/padding state per call: not safe from two threads."""

    def load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._load()
            self._loaded = True

    def _load(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a consumer's log is not a terminal
        if self.config.torch_threads > 0:
            torch.set_num_threads(self.config.torch_threads)
        source = resolve_model_source(self.config.model_path)
        if source.gguf_file:
            source = convert_once(source, AutoModel if self.task == "embed" else AutoModelForCausalLM)
        hf_config = AutoConfig.from_pretrained(source.directory)
        task = self.task or detect_task(hf_config)
        tokenizer = AutoTokenizer.from_pretrained(source.directory)
        tokenizer.model_max_length = 1 << 30  # check() enforces the real limit; no per-call warning
        if task == "generate":
            tokenizer.padding_side = "left"
        model: Any = None  # a torch module; transformers' own annotations of `to` do not type-check
        generation_config = None
        if self.weights:
            auto = AutoModelForCausalLM if task == "generate" else AutoModel
            self.device = pick_device(self.config.device)
            model = auto.from_pretrained(source.directory, config=hf_config, dtype=pick_dtype(self.device))
            model.to(self.device).eval()
            if task == "generate":
                from .fused_step import install

                install(model)
            generation_config = getattr(model, "generation_config", None)
        self._stop_ids = stop_token_ids(hf_config, generation_config, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else min(self._stop_ids, default=0)
        self._vocab_size = int(
            model.get_input_embeddings().num_embeddings if model is not None else hf_config.vocab_size
        )
        positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
        limit = self.config.max_input_tokens
        if positions:
            room = positions - (self.config.max_new_tokens if task == "generate" else 0)
            limit = min(limit, max(1, room))
        self.max_input_tokens = limit
        self._positions = positions
        self.source, self.task = source, task
        self._tokenizer = tokenizer
        self._model = model
        if model is not None and task == "generate" and self.config.batching == "iteration":
            from .iteration import IterationScheduler, running_token_cap

            profile = self.config.profile
            target = profile.target_size if isinstance(profile.target_size, int) else None
            running_cap = running_token_cap(self._token_cap, profile.max_inflight_batches, target)
            budget = profile.slo_ms_per_new_token or profile.compute_budget_ms or profile.slo_p99_ms / 2.0
            self.iteration = IterationScheduler(
                self._running_set,
                self._to_output,
                token_cap=running_cap,
                step_budget_ms=budget,
                step_token_budget=self.config.step_token_budget,
                fused_chunks=self.config.fused_chunks,
                tpot_ms=profile.slo_ms_per_new_token or None,
            )

    def _ids(self, req: Request) -> list[int]:
        """Input ids of one request, tokenizing a text at most once."""
        if req.token_ids is not None:
            return req.token_ids
        text = req.text or ""
        ids = self._encoded.get(req.id, text)
        if ids is None:
            ids = self._tokenize([text])[0]
            self._encoded.put(req.id, text, ids)
        return ids

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        with self._tokenizer_lock:
            ids: list[list[int]] = self._tokenizer(texts, add_special_tokens=True)["input_ids"]
            return ids

    def _new_tokens(self, req: Request) -> int:
        """Tokens this request may generate: what it asked (or the default), never over the
        model's cap (check() refuses a request asking more; run() still holds the cap)."""
        asked = req.params.max_new_tokens if req.params is not None else _DEFAULT_NEW_TOKENS
        return min(asked, self.config.max_new_tokens)

    def measure(self, req: Request) -> tuple[int, int]:
        self.load()
        tokens_in = len(self._ids(req))
        return tokens_in, (self._new_tokens(req) if self.task == "generate" else 0)

    def check(self, req: Request) -> str | None:
        self.load()
        if self.task == "generate":
            why = self._check_generation(req)
            if why is not None:
                return why
        ids = self._ids(req)
        if len(ids) > self.max_input_tokens:
            return f"input is {len(ids)} tokens; this model accepts at most {self.max_input_tokens}" + (
                f" (context {self._positions} less max_new_tokens {self.config.max_new_tokens})"
                if self.task == "generate" and self._positions
                else ""
            )
        if not ids:
            return "input is empty after tokenization"
        if self._token_cap is not None and len(ids) + self._new_tokens(req) > self._token_cap:
            return (
                f"request needs {len(ids) + self._new_tokens(req)} tokens (prompt {len(ids)} + max_new_tokens "
                f"{self._new_tokens(req)}) but a batch holds at most {self._token_cap} (hard_cap, tokens): it could never run"
            )
        if req.token_ids is not None:
            top = max(ids)
            if top >= self._vocab_size:
                return f"token id {top} is outside the vocabulary (size {self._vocab_size})"
        return None

    def _check_generation(self, req: Request) -> str | None:
        if req.params is not None and req.params.max_new_tokens > self.config.max_new_tokens:
            return (
                f"max_new_tokens {req.params.max_new_tokens} is over this model's limit "
                f"{self.config.max_new_tokens} (1..{self.config.max_new_tokens} accepted)"
            )
        if req.token_ids is None and not (req.text or "").strip():
            return "empty prompt: a generation request needs text or token_ids"
        if req.token_ids is not None and not req.token_ids:
            return "empty prompt: token_ids is an empty list"
        return None

    def _batch_ids(self, reqs: list[Request]) -> list[list[int]]:
        """Ids for every request: cached ones taken, the rest tokenized in one call."""
        ids: list[list[int]] = []
        missing: list[int] = []
        for i, r in enumerate(reqs):
            if r.token_ids is not None:
                ids.append(r.token_ids)
                continue
            cached = self._encoded.get(r.id, r.text or "", take=True)
            if cached is None:
                missing.append(i)
            ids.append(cached or [])
        if missing:
            for i, encoded in zip(missing, self._tokenize([reqs[i].text or "" for i in missing]), strict=True):
                ids[i] = encoded
        return ids

    def _padded(self, ids: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):
            start = width - len(seq) if left else 0
            input_ids[row, start : start + len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, start : start + len(seq)] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def with_token_ids(self, reqs: list[Request]) -> list[Request]:
        """The batch with every text replaced by its ids: what a device process is sent."""
        ids = self._batch_ids(reqs)
        return [
            r if r.token_ids is not None else msgspec.structs.replace(r, text=None, token_ids=i)
            for r, i in zip(reqs, ids, strict=True)
        ]

    def run(self, reqs: list[Request]) -> list[Output]:
        if not reqs:
            return []
        self.load()
        if self._model is None:
            raise RuntimeError(f"model {self.name!r}: this runner was built without weights (a device process's front)")
        import torch

        if self.device and self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        ids = self._batch_ids(reqs)
        with torch.inference_mode():
            if self.task == "generate":
                return self._generate(reqs, ids)
            return self._embed(ids)

    def _embed(self, ids: list[list[int]]) -> list[Output]:
        import torch

        input_ids, mask = self._padded(ids, left=False)
        hidden = self._model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return [Output(embedding=row) for row in pooled.float().cpu().tolist()]

    def _generate(self, reqs: list[Request], ids: list[list[int]]) -> list[Output]:
        reserve = self.config.max_new_tokens if self.iteration is not None else None
        seqs = [
            Sequence(
                prompt,
                self._new_tokens(r),
                reserve=reserve,
                deadline_ms=r.deadline_ms,
                priority=r.priority,
                first_token_by_ms=r.first_token_deadline_ms,
                ignore_eos=r.params is not None and r.params.ignore_eos,
            )
            for r, prompt in zip(reqs, ids, strict=True)
        ]
        if self.iteration is not None:
            return self.iteration.run(seqs)
        decode_all(self._running_set(), seqs)
        return [self._to_output(s) for s in seqs]

    def _running_set(self) -> RunningSet:
        assert self.device is not None
        return RunningSet(self._model, self.device, self._pad_id, self._stop_ids)

    def _to_output(self, seq: Sequence) -> Output:
        with self._tokenizer_lock:
            text = self._tokenizer.decode(seq.generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return Output(
            text=text,
            token_ids=list(seq.generated),
            tokens_out=len(seq.generated),
            first_token_ms=seq.first_token_ms,
            last_token_ms=seq.last_token_ms,
            expired=seq.expired,
            refused=seq.refused,
        )

    def device_memory(self) -> tuple[int, MemoryKind]:
        if self.device and self.device.startswith("cuda"):
            import torch

            return int(torch.cuda.max_memory_allocated(self.device)), "cuda_max_allocated"
        return process_rss()

    def timed_steps(self) -> list[tuple[int, float]]:
        """The decode loop's plain steps (rows, ms) timed since the last call (none without one)."""
        return self.iteration.timed_steps() if self.iteration is not None else []

    def close(self) -> None:
        if self.iteration is not None:
            self.iteration.close()
