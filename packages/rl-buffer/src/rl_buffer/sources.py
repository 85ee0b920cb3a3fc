"""Prompt data sources: JSONL, Parquet and local Hugging Face ``datasets``, and weighted mixtures.

Every file source reads its records once at construction, checks them (a malformed line or a
missing key raises :class:`~rl_core.errors.DataError` naming the file, line and key), tokenizes
every prompt, and drops prompts longer than ``max_prompt_tokens`` (counted and logged, never
truncated; when it is unset, the tokenizer's ``model_max_length`` is the limit if it has one).
Draws then walk a per-epoch permutation seeded by ``(seed, epoch)``; the cursor (epoch, position)
is the whole state, so resuming is exact. Parquet and ``datasets`` sources keep their prompts in
memory; :class:`JsonlSource` keeps only an index (byte offset, length, line and row of each kept
record: 28 bytes a row) and reads, parses and tokenizes a record again when it is drawn, so a
file of millions of rows costs megabytes, not gigabytes (the file must not change while the
source reads it; a change is a ``DataError``). While reading, prompts are tokenized 1024 at a time
through a Hugging Face fast tokenizer's backend where that provably gives ``tokenizer.encode``'s
ids (see ``_batch_encoder``), else one ``encode`` per record. :class:`JsonlSource`, which keeps
no ids, does not tokenize a prompt at all while indexing when its token count is provably within
the limit: for a byte-level BPE tokenizer (GPT-2, SmolLM2, Qwen2 style) a text gives at most its
UTF-8 bytes plus the added special tokens (see ``_length_bound``); it is encoded when drawn::

    tok = AutoTokenizer.from_pretrained(model_dir)
    src = JsonlSource(JsonlSource.Config(path="data/math.jsonl@[0:1000]",
                                         apply_chat_template=True, max_prompt_tokens=1024), tok)
    prompts = src.next_prompts(32)           # Prompt(uid="math:0:417", token_ids=(...), label=...)
    ckpt = src.state_dict()                  # {"epoch": 0, "position": 32, ...}

A record's input (``input_key``) is plain text or a list of chat messages
(``[{"role": "user", "content": "..."}]``). With ``apply_chat_template`` the tokenizer's chat
template renders it (text becomes one user message) with ``add_generation_prompt=True`` and
``chat_template_kwargs``; the rendered text is then encoded without extra special tokens. Without
it, text is encoded directly and chat messages are an error.

Chat messages must use one of ``chat_roles`` (``system``, ``user``, ``assistant``, ``tool``): a
template renders an unknown role wrongly or drops it without a word. ``unknown_roles`` says what
happens to such a record: ``refuse`` (default) raises ``DataError`` naming ``file:line``;
``skip`` drops it (counted in ``num_dropped_unknown_role`` and logged).

Text files are read as UTF-8; a leading byte-order mark is accepted (``utf-8-sig``). Every data
error (undecodable bytes, malformed JSON, a line that is not an object, a missing key, a wrong
type) is a ``DataError`` naming ``file:line`` (Parquet and ``datasets``: ``file:row N``).
"""

from __future__ import annotations

import array
import codecs
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np

from rl_core.config import InputPath, PositiveInt, Seed
from rl_core.errors import CheckpointError, ConfigError, DataError, RLError
from rl_core.interfaces import DataSource, Tokenizer
from rl_core.types import Prompt

try:  # optional (rlpost-buffer[fast]): parses JSON lines ~5x faster than json.loads
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - exercised by monkeypatching _orjson_loads
    _orjson_loads = None

__all__ = [
    "FileSource",
    "HFDatasetSource",
    "JsonlSource",
    "MixtureSource",
    "ParquetSource",
    "SourceConfig",
    "parse_sliced_path",
]

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"^(?P<path>.*)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
"""Default ``SourceConfig.chat_roles``: the roles every common chat template renders."""

# Hugging Face tokenizers without a known limit report model_max_length = int(1e30).
_NO_MODEL_LIMIT = 10**18


def parse_sliced_path(path: str) -> tuple[str, slice]:
    """Split ``"file.jsonl@[a:b]"`` into the file and a Python slice of its records.

    Either bound may be omitted or negative, as in Python: ``@[:100]``, ``@[-50:]``. A path
    without ``@[...]`` selects every record.
    """
    m = _SLICE_RE.match(path)
    if m is None:
        return path, slice(None)
    start = int(m["start"]) if m["start"] else None
    stop = int(m["stop"]) if m["stop"] else None
    return m["path"], slice(start, stop)


@dataclass(kw_only=True, slots=True)
class SourceConfig:
    """Options shared by every file-backed prompt source."""

    path: Annotated[str, InputPath()]
    """File (or dataset directory) to read; ``path@[a:b]`` keeps records ``a`` to ``b`` (Python
    slice semantics over the records in file order). A relative path resolves against the
    recipe's directory."""
    name: str | None = None
    """Source name used in prompt uids and metrics; default: the file name without suffix."""
    input_key: str = "prompt"
    """Record key of the prompt: a string, or a list of chat messages."""
    label_key: str | None = "label"
    """Record key of the reference answer; ``None`` if the data has no labels."""
    metadata_key: str | None = None
    """Record key of a dict (or a JSON string of one) merged into ``Prompt.metadata``."""
    tools_key: str | None = None
    """Record key of a tool list, passed to the chat template as ``tools=`` and kept in
    ``Prompt.metadata["tools"]``."""
    apply_chat_template: bool = False
    """Render the input with the tokenizer's chat template (with a generation prompt)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking``)."""
    add_special_tokens: bool = True
    """For plain text without a chat template: let the tokenizer add its special tokens (BOS)."""
    max_prompt_tokens: PositiveInt | None = None
    """Prompts with more tokens are dropped (counted and logged), never truncated."""
    shuffle: bool = True
    """Shuffle the records every epoch."""
    seed: Seed = 0
    """Seed of the shuffle; epoch ``e`` uses the permutation seeded by ``(seed, e)``."""
    chat_roles: tuple[str, ...] = CHAT_ROLES
    """Roles chat messages may use; add a role (e.g. ``developer``, ``ipython``) only if your
    chat template renders it."""
    unknown_roles: Literal["refuse", "skip"] = "refuse"
    """A record whose chat messages use a role outside ``chat_roles``: ``refuse`` raises
    ``DataError`` naming ``file:line``; ``skip`` drops the record (counted and logged)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data_source.path: empty; set the file to read.")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(
                f"data_source.max_prompt_tokens: must be >= 1 or None, got {self.max_prompt_tokens}."
            )
        if not self.input_key:
            raise ConfigError("data_source.input_key: empty; name the record key of the prompt.")
        if self.unknown_roles not in ("refuse", "skip"):
            raise ConfigError(
                f"data_source.unknown_roles: {self.unknown_roles!r}; choose 'refuse' or 'skip'."
            )
        if not self.chat_roles or not all(isinstance(r, str) and r for r in self.chat_roles):
            raise ConfigError(
                f"data_source.chat_roles: {self.chat_roles!r}; list the role names the chat "
                f"template renders (default {list(CHAT_ROLES)})."
            )


@dataclass(slots=True)
class _Row:
    row: int
    input: str | list[dict[str, Any]]
    token_ids: tuple[int, ...]
    label: Any
    metadata: dict[str, Any]


class FileSource(DataSource):
    """Base of the file-backed sources: record checking, tokenization, length filter, per-epoch
    shuffle and the exact cursor. Subclasses implement :meth:`_read_records`."""

    Config = SourceConfig
    _keeps_token_ids = True  # the kept rows hold their ids (JsonlSource: re-encoded when drawn)

    def __init__(self, config: SourceConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        file, self._slice = parse_sliced_path(config.path)
        self.file = Path(file)
        self.name: str = config.name or self.file.name.split(".")[0]
        """Source name (uids are ``f"{name}:{epoch}:{row}"``)."""
        if not self.file.exists():
            raise DataError(f"{self.file}: no such file or directory (data_source.path).")
        self.num_records = 0
        """Records read (after slicing, before the length filter)."""
        self.num_dropped_too_long = 0
        """Records dropped because their prompt exceeds ``max_prompt_tokens``."""
        self.num_dropped_unknown_role = 0
        """Records dropped (``unknown_roles: skip``) for a chat role outside ``chat_roles``."""
        limit, limit_name = self._prompt_limit()
        self.max_prompt_tokens: int | None = limit
        """The length limit applied: ``max_prompt_tokens``, else the tokenizer's
        ``model_max_length`` when it has one, else ``None`` (no limit)."""
        self._rows: list[_Row] = []
        self._kept = 0
        self._skipped_roles: list[str] = []
        too_long: list[str] = []
        self._batch_encode = _batch_encoder(tokenizer)
        self._batch_checked = False
        # Without kept ids, a prompt whose token count is bounded within the limit is kept
        # untokenized (see _length_bound); the others are tokenized as before.
        bound = None if self._keeps_token_ids else _length_bound(tokenizer)
        add_special = self._add_special_tokens
        # (row, text to encode or None when it provably fits, where, locator), in file order
        pending: list[tuple[_Row, str | None, str, Any]] = []
        to_encode = 0

        def fits(text: str) -> bool:
            """True when ``text`` provably encodes to 1..limit tokens (no need to encode it)."""
            n = bound.max_tokens(text, add_special) if bound is not None else None
            return n is not None and (self.max_prompt_tokens is None or n <= self.max_prompt_tokens)

        def flush() -> None:
            """Tokenize the pending records as one batch, then filter and keep them in order."""
            nonlocal to_encode
            todo = [(text, w) for _, text, w, _ in pending if text is not None]
            encoded = iter(self._encode_many([t for t, _ in todo], [w for _, w in todo]))
            to_encode = 0
            for r, text, where, locator in pending:
                if text is None:  # provably 1..limit tokens
                    self._keep(r, locator)
                    self._kept += 1
                    continue
                row_ids = next(encoded)
                if not len(row_ids):
                    _checked_ids(row_ids, where)  # raises: zero tokens
                if self._keeps_token_ids:  # else only the length is needed here
                    r.token_ids = _checked_ids(_ids(row_ids), where)
                if self.max_prompt_tokens is not None and len(row_ids) > self.max_prompt_tokens:
                    self.num_dropped_too_long += 1
                    if len(too_long) < 5:
                        too_long.append(f"{where} ({len(row_ids)} tokens)")
                    continue
                self._keep(r, locator)
                self._kept += 1
            pending.clear()

        try:
            for row, where, record, locator in self._read_records():
                self.num_records += 1
                prepared = self._prepare(row, where, record)
                if prepared is None:
                    self.num_dropped_unknown_role += 1
                    continue
                text: str | None = prepared[1]
                if fits(text):
                    text = None
                else:
                    to_encode += 1
                pending.append((prepared[0], text, where, locator))
                if to_encode >= (_ENCODE_BATCH if self._batch_encode else 1) or (
                    len(pending) >= _ENCODE_BATCH
                ):
                    flush()
        except RLError:
            flush()  # an error in an earlier record of the batch is reported first
            raise
        flush()
        if self.num_dropped_too_long:
            logger.warning(
                "%s: dropped %d of %d prompts longer than %s (first: %s); raise "
                "data_source.max_prompt_tokens to keep them, or shorten those records.",
                self.file,
                self.num_dropped_too_long,
                self.num_records,
                limit_name,
                ", ".join(too_long),
            )
        if self.num_dropped_unknown_role:
            logger.warning(
                "%s: skipped %d of %d records whose chat messages use a role outside "
                "data_source.chat_roles=%s (unknown_roles=skip; first: %s); add the role to "
                "chat_roles if your chat template renders it.",
                self.file,
                self.num_dropped_unknown_role,
                self.num_records,
                list(config.chat_roles),
                ", ".join(self._skipped_roles),
            )
        if not self._kept:
            raise DataError(
                f"{config.path}: no prompts left ({self.num_records} records read, "
                f"{self.num_dropped_too_long} longer than {limit_name or 'max_prompt_tokens'}, "
                f"{self.num_dropped_unknown_role} with an unknown chat role). Check the path, "
                "the slice, data_source.max_prompt_tokens and data_source.chat_roles."
            )
        self._epoch = 0
        self._pos = 0
        self._order = self._epoch_order(0)

    # -- reading ---------------------------------------------------------------------------

    def _prompt_limit(self) -> tuple[int | None, str]:
        """The prompt length limit and how to name it in messages."""
        limit = self.config.max_prompt_tokens
        model_max = getattr(self.tokenizer, "model_max_length", None)
        if not isinstance(model_max, int) or not 0 < model_max < _NO_MODEL_LIMIT:
            model_max = None
        if limit is not None:
            if model_max is not None and limit > model_max:
                logger.warning(
                    "%s: data_source.max_prompt_tokens=%d exceeds the tokenizer's "
                    "model_max_length=%d; longer prompts will fail at generation. Lower "
                    "max_prompt_tokens.",
                    self.file,
                    limit,
                    model_max,
                )
            return limit, f"data_source.max_prompt_tokens={limit}"
        if model_max is not None:
            return model_max, (
                f"the tokenizer's model_max_length={model_max} (data_source.max_prompt_tokens "
                "is unset)"
            )
        return None, ""

    def _read_records(self) -> Iterable[tuple[int, str, Any, Any]]:
        """``(row index, location for messages, record, locator)`` for every record in the slice;
        the locator is what :meth:`_keep` needs to find the record again (``None`` for sources
        that keep their prompts in memory)."""
        raise NotImplementedError

    def _keep(self, row: _Row, locator: Any) -> None:
        """Keep a prompt that passed the filters (in memory; :class:`JsonlSource` keeps its
        locator instead)."""
        self._rows.append(row)

    def _rows_at(self, indices: Sequence[int]) -> list[_Row]:
        """The kept prompts at ``indices`` (positions among the kept prompts)."""
        return [self._rows[i] for i in indices]

    def _get(self, record: Any, key: str, where: str, option: str) -> Any:
        if not isinstance(record, Mapping):
            raise DataError(
                f"{where}: expected a JSON object (a mapping of keys), got {type(record).__name__}."
            )
        if key not in record:
            keys = ", ".join(sorted(map(str, record))[:10])
            raise DataError(
                f"{where}: missing key {key!r} (keys present: {keys}). Set {option} to the key "
                "that holds it, or fix the record."
            )
        return record[key]

    def _convert(self, row: int, where: str, record: Any) -> _Row | None:
        """The checked, tokenized prompt of a record, or ``None`` (a chat role to skip)."""
        prepared = self._prepare(row, where, record)
        if prepared is None:
            return None
        r, text = prepared
        r.token_ids = _checked_ids(_ids(self._encode_many([text], [where])[0]), where)
        return r

    def _prepare(self, row: int, where: str, record: Any) -> tuple[_Row, str] | None:
        """A record checked and rendered, not yet tokenized: the row (``token_ids`` empty) and
        the text to encode; ``None`` for a record to skip (a chat role outside ``chat_roles``)."""
        cfg = self.config
        inp = self._get(record, cfg.input_key, where, "input_key")
        label = self._get(record, cfg.label_key, where, "label_key") if cfg.label_key else None
        metadata: dict[str, Any] = {}
        if cfg.metadata_key:
            meta = self._get(record, cfg.metadata_key, where, "metadata_key")
            if isinstance(meta, str):
                meta = _parse_json(meta, where, f"key {cfg.metadata_key!r} is a string but not")
            if meta is not None and not isinstance(meta, Mapping):
                raise DataError(
                    f"{where}: key {cfg.metadata_key!r} must be an object, got "
                    f"{type(meta).__name__}."
                )
            metadata.update(meta or {})
        tools = None
        if cfg.tools_key:
            tools = self._get(record, cfg.tools_key, where, "tools_key")
            metadata["tools"] = tools
        metadata["source"] = self.name
        metadata["row"] = row
        if isinstance(inp, str):
            pass
        elif (
            isinstance(inp, list)
            and inp
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in inp)
        ):
            inp = [dict(m) for m in inp]
            if not self._roles_known(inp, where):
                return None
        else:
            got = "an empty list" if isinstance(inp, list) and not inp else type(inp).__name__
            raise DataError(
                f"{where}: key {cfg.input_key!r} must be a string or a non-empty list of chat "
                f"messages ({{'role': ..., 'content': ...}}), got {got}. Fix the record or set "
                "input_key to the key that holds the prompt."
            )
        return _Row(row, inp, (), label, metadata), self._render(inp, tools, where)

    def _roles_known(self, messages: list[dict[str, Any]], where: str) -> bool:
        """True if every message's role is in ``chat_roles``; False (skip the record) or
        :class:`DataError` (refuse) otherwise, as ``unknown_roles`` says."""
        cfg = self.config
        for i, m in enumerate(messages):
            role = m["role"]
            if isinstance(role, str) and role in cfg.chat_roles:
                continue
            if cfg.unknown_roles == "skip":
                if len(self._skipped_roles) < 5:
                    self._skipped_roles.append(f"{where} role {role!r}")
                return False
            raise DataError(
                f"{where}: message {i} has role {role!r}, not one of data_source.chat_roles="
                f"{list(cfg.chat_roles)}; a chat template renders an unknown role wrongly or "
                "drops it silently. Fix the record, add the role to chat_roles if your template "
                "renders it, or set unknown_roles: skip to drop such records."
            )
        return True

    @property
    def _add_special_tokens(self) -> bool:
        """Whether encoding adds the tokenizer's special tokens: never for rendered chat text
        (the template wrote them), else ``add_special_tokens``."""
        return self.config.add_special_tokens and not self.config.apply_chat_template

    def _render(self, inp: str | list[dict[str, Any]], tools: Any, where: str) -> str:
        """The text to encode: the input itself, or the chat template's rendering of it."""
        cfg = self.config
        if not cfg.apply_chat_template:
            if not isinstance(inp, str):
                raise DataError(
                    f"{where}: key {cfg.input_key!r} holds chat messages but apply_chat_template "
                    "is false; set apply_chat_template=true to render them."
                )
            return inp
        messages = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
        kwargs = dict(cfg.chat_template_kwargs)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # the template is user code (Jinja); name the record
            raise DataError(f"{where}: the chat template failed on this record: {e}") from e
        if not isinstance(text, str):
            raise DataError(
                f"{where}: the chat template returned {type(text).__name__}, not text; "
                "check the tokenizer's chat template."
            )
        return text

    def _encode_many(self, texts: list[str], wheres: list[str]) -> list[Any]:
        """Every text encoded, with exactly the ids ``tokenizer.encode`` gives one at a time
        (an ``Encoding`` of the batch encoder or ``encode()``'s list: read them with
        :func:`_ids`; ``len()`` is the number of tokens of both):
        one call to the tokenizer's fast backend when :func:`_batch_encoder` proved it the same
        (and the first batch checked it), else one ``encode`` per text."""
        add = self._add_special_tokens
        if self._batch_encode is not None and len(texts) > 1:
            try:
                out = self._batch_encode(texts, add)
            except Exception:  # e.g. a lone surrogate: per row below names the record
                out = None
            if out is not None and not self._batch_checked:
                n = min(len(texts), _CHECK_ROWS)
                if [_ids(x) for x in out[:n]] != [
                    self._encode(t, w, add) for t, w in zip(texts[:n], wheres[:n])
                ]:
                    logger.warning(
                        "%s: the tokenizer's batch encoding differs from encode() on the first "
                        "records; tokenizing one record at a time (slower, same ids).",
                        self.file,
                    )
                    self._batch_encode = out = None
                self._batch_checked = True
            if out is not None:
                return out
        return [self._encode(t, w, add) for t, w in zip(texts, wheres)]

    def _encode(self, text: str, where: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode`` of one text, or :class:`DataError` naming the record."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # the tokenizer is third-party code; name the record
            raise DataError(
                f"{where}: the tokenizer failed on this record ({type(e).__name__}: {e}); fix "
                "the text (e.g. a lone surrogate escape such as \\ud800) or remove the record."
            ) from e

    # -- drawing ---------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> np.ndarray:
        order = np.arange(self._kept)
        if self.config.shuffle:
            np.random.default_rng([self.config.seed, epoch]).shuffle(order)
        return order

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts in this epoch's order, rolling into the next epoch as needed.

        Uids are ``f"{name}:{epoch}:{row}"`` (row: record index in the file), unique per draw.
        """
        if n < 0:
            raise ValueError(f"next_prompts: n must be >= 0, got {n}.")
        epochs: list[int] = []
        indices: list[int] = []
        while len(indices) < n:
            if self._pos == self._kept:
                self._epoch += 1
                self._pos = 0
                self._order = self._epoch_order(self._epoch)
            epochs.append(self._epoch)
            indices.append(int(self._order[self._pos]))
            self._pos += 1
        out: list[Prompt] = []
        for epoch, r in zip(epochs, self._rows_at(indices)):
            inp = r.input if isinstance(r.input, str) else [dict(m) for m in r.input]
            out.append(
                Prompt(
                    uid=f"{self.name}:{epoch}:{r.row}",
                    input=inp,
                    token_ids=r.token_ids,
                    label=r.label,
                    metadata={**r.metadata, "epoch": epoch},
                )
            )
        return out

    def __len__(self) -> int:
        """Prompts per epoch (records kept after the length filter)."""
        return self._kept

    @property
    def epoch(self) -> int:
        """Current epoch (0-based)."""
        return self._epoch

    def stats(self) -> dict[str, float]:
        """Counters as metrics: records read, prompts kept, prompts dropped as too long or for
        an unknown chat role."""
        p = f"data/{self.name}"
        return {
            f"{p}/records": float(self.num_records),
            f"{p}/prompts": float(self._kept),
            f"{p}/dropped_too_long": float(self.num_dropped_too_long),
            f"{p}/dropped_unknown_role": float(self.num_dropped_unknown_role),
            f"{p}/epoch": float(self._epoch),
        }

    def state_dict(self) -> dict[str, Any]:
        """The cursor: ``{"name", "epoch", "position", "num_prompts", "seed"}``."""
        return {
            "name": self.name,
            "epoch": self._epoch,
            "position": self._pos,
            "num_prompts": self._kept,
            "seed": self.config.seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor; refuses a state of a different source or dataset size."""
        missing = [k for k in ("name", "epoch", "position", "num_prompts") if k not in state]
        if missing:
            raise CheckpointError(
                f"data source {self.name!r}: state lacks {missing}; it is not a "
                f"{type(self).__name__} cursor."
            )
        if state["name"] != self.name or state["num_prompts"] != self._kept:
            raise CheckpointError(
                f"data source {self.name!r}: the checkpoint is for source {state['name']!r} with "
                f"{state['num_prompts']} prompts, but this one has {self._kept}; the data "
                "or its slice/filters changed since the checkpoint. Restore the same data."
            )
        if not 0 <= int(state["position"]) <= self._kept or int(state["epoch"]) < 0:
            raise CheckpointError(f"data source {self.name!r}: cursor out of range: {dict(state)}.")
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._order = self._epoch_order(self._epoch)


class JsonlSource(FileSource):
    """Prompts from a JSON-lines file, one JSON object per line (blank lines are skipped).

    See :class:`SourceConfig` for the options; the slice ``@[a:b]`` counts non-blank lines.
    The file is UTF-8, optionally with a byte-order mark. Errors name ``file:line``.

    The file is read twice at construction, a chunk at a time (first every line's encoding, then
    the records of the slice); the source keeps an index of the prompts (byte offset, length,
    line, row: 28 bytes each), not the prompts, and reads a drawn record again from the file.
    Draws are the same prompts in the same order as an in-memory source of the same records.

    Raises:
        DataError: at a draw, when the file changed since it was indexed (size or modification
            time): restore it, or start the run again to index the new file.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(SourceConfig):
        """Options of :class:`JsonlSource` (all from :class:`SourceConfig`)."""

    _keeps_token_ids = False

    def __init__(self, config: SourceConfig, tokenizer: Tokenizer) -> None:
        self._offsets = array.array("q")  # byte offset of each kept record's line
        self._lengths = array.array("i")  # its length in bytes (no line terminator)
        self._linenos = array.array("q")  # its line number (for messages)
        self._row_ids = array.array("q")  # its row (index among non-blank lines)
        super().__init__(config, tokenizer)
        stat = self.file.stat()
        self._signature = (stat.st_size, stat.st_mtime_ns)

    def _read_records(self) -> Iterator[tuple[int, str, Any, Any]]:
        start, stop = self._slice.start or 0, self._slice.stop
        if start < 0 or (stop is not None and stop < 0):  # counted from the end: count the rows
            num_lines = sum(map(len, _jsonl_line_batches(self.file)))  # every line decodes first
            rows = range(num_lines)[self._slice]
            start, stop = rows.start, rows.stop
        else:
            _check_utf8(self.file)  # every line decodes first
        name = str(self.file)
        row = -1
        for batch in _jsonl_line_batches(self.file):
            for lineno, offset, raw in batch:
                row += 1
                if row < start:
                    continue
                if stop is not None and row >= stop:
                    return
                where = f"{name}:{lineno}"
                yield row, where, _parse_json_bytes(raw, where), (offset, len(raw), lineno)

    def _keep(self, row: _Row, locator: Any) -> None:
        offset, length, lineno = locator
        self._offsets.append(offset)
        self._lengths.append(length)
        self._linenos.append(lineno)
        self._row_ids.append(row.row)

    def _rows_at(self, indices: Sequence[int]) -> list[_Row]:
        stat = self.file.stat() if self.file.exists() else None
        if stat is None or (stat.st_size, stat.st_mtime_ns) != self._signature:
            raise DataError(
                f"{self.file}: changed (or removed) since the source indexed it; a JSON-lines "
                "source reads its records from the file when they are drawn. Restore the file, "
                "or start the run again (resuming from a checkpoint) to index the new one."
            )
        out = []
        with self.file.open("rb") as f:
            for i in indices:
                f.seek(self._offsets[i])
                raw = f.read(self._lengths[i])
                where = f"{self.file}:{self._linenos[i]}"
                r = self._convert(self._row_ids[i], where, _parse_json_bytes(raw, where))
                assert r is not None  # it passed the same filters when indexed
                out.append(r)
        return out


_CHUNK = 1 << 20  # bytes read at a time; a chunk's lines are held as one batch (~10 MB at 1M rows)
_LINE_ENDS = (b"\n", b"\r")


def _jsonl_line_batches(file: Path) -> Iterator[list[tuple[int, int, bytes]]]:
    """``(line number, byte offset, bytes)`` of every non-blank line of a UTF-8 file, one list
    per chunk read (bytes without the line terminator; a leading byte-order mark is skipped;
    lines end at ``\\n``, ``\\r\\n`` or ``\\r``, as Python's universal newlines; a line is blank
    when its text is only whitespace, as ``str.strip`` counts it). Undecodable bytes raise
    :class:`DataError` naming ``file:line``."""
    lineno = 0
    with file.open("rb") as f:
        carry = f.read(len(codecs.BOM_UTF8))
        base = 0  # file offset of carry[0]
        if carry == codecs.BOM_UTF8:
            carry, base = b"", len(codecs.BOM_UTF8)
        while True:
            more = f.read(_CHUNK)
            eof = not more
            data = carry + more
            if eof:
                cut = len(data)
            else:  # whole lines only; a \r last in the chunk may be the start of a \r\n
                end = len(data) - 1 if data.endswith(b"\r") else len(data)
                cut = max(data.rfind(b"\n", 0, end), data.rfind(b"\r", 0, end)) + 1
            body, carry = data[:cut], data[cut:]
            try:
                body.decode("utf-8")  # terminators are ASCII: no character spans two lines
                decodes = True
            except UnicodeDecodeError:
                decodes = False
            batch = []
            offset = base
            for piece in body.splitlines(keepends=True):  # bytes: at \n, \r\n and \r only
                lineno += 1
                raw = piece.rstrip(b"\r\n")  # a piece ends in one terminator at most
                if not decodes:
                    _decode_line(raw, file, lineno)  # raises at the first undecodable line
                head = raw.lstrip()  # ASCII whitespace; the text may start with other spaces
                if head and (
                    (head[0] < 0x80 and not 0x1C <= head[0] <= 0x1F) or raw.decode("utf-8").strip()
                ):
                    batch.append((lineno, offset, raw))
                offset += len(piece)
            base += cut
            if batch:
                yield batch
            if eof:
                return


def _jsonl_line_spans(file: Path) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset, bytes)`` of every non-blank line of a UTF-8 file
    (:func:`_jsonl_line_batches`, one line at a time)."""
    for batch in _jsonl_line_batches(file):
        yield from batch


def _check_utf8(file: Path) -> None:
    """:class:`DataError` naming ``file:line`` when the file is not UTF-8 (one fast pass; the
    line is found only when there is an error)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        for _ in _jsonl_line_batches(file):  # raises naming the line
            pass
        raise AssertionError(f"{file}: not UTF-8, but every line decodes") from None


def _decode_line(raw: bytes, file: Path, lineno: int) -> str:
    """``raw`` as UTF-8, or :class:`DataError` naming the line and column of the bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        column = len(raw[: e.start].decode("utf-8")) + 1
        raise DataError(
            f"{file}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {column}). "
            "Save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 in.jsonl > out.jsonl) or "
            "remove the line."
        ) from None


def _jsonl_lines(file: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a UTF-8 file
    (:func:`_jsonl_line_spans`, decoded)."""
    return [(lineno, raw.decode("utf-8")) for lineno, _, raw in _jsonl_line_spans(file)]


_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def _parse_json_bytes(raw: bytes, where: str) -> Any:
    """A UTF-8 line parsed as :func:`_parse_json` does: through ``orjson`` when it is installed
    and accepts the line (the same values as ``json.loads``), else ``json.loads`` (``NaN``,
    integers beyond 64 bits, lone surrogate escapes, and errors). A line with 19 digits in a
    row goes to ``json.loads``: orjson reads an integer beyond 64 bits as a float."""
    if _orjson_loads is not None and not _LONG_DIGITS.search(raw):
        try:
            return _orjson_loads(raw)
        except ValueError:  # orjson.JSONDecodeError: json.loads decides (and names the error)
            pass
    return _parse_json(raw.decode("utf-8"), where)


def _parse_json(text: str, where: str, what: str = "malformed") -> Any:
    """``json.loads(text)``, or :class:`DataError` naming ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        detail = f"{e.msg} at column {e.colno}"
    except (ValueError, RecursionError) as e:  # e.g. a 5000-digit integer, nesting too deep
        detail = str(e) or type(e).__name__
    raise DataError(f"{where}: {what} JSON ({detail}). Fix or remove the record.")


_ENCODE_BATCH = 1024
"""Records tokenized per call of the tokenizer's fast backend while a source reads its file
(held until then: about half a megabyte of short prompts); one at a time without a batch encoder."""
_CHECK_ROWS = 64
"""Records of the first batch also encoded one at a time, to check the batch gives their ids."""


def _ids(encoded: Any) -> Sequence[int]:
    """The ids of what :meth:`FileSource._encode_many` gave: a batch encoder's ``Encoding`` or
    ``encode()``'s list."""
    ids = getattr(encoded, "ids", None)
    return encoded if ids is None else ids


def _checked_ids(ids: Sequence[int], where: str) -> tuple[int, ...]:
    """``ids`` as a tuple of ints, or :class:`DataError` when there are none."""
    out = tuple(map(int, ids))
    if not out:
        raise DataError(f"{where}: the prompt tokenizes to zero tokens; remove the record.")
    return out


def _fast_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer whose ``encode(text)``
    is exactly that backend's ``encode_batch([text])`` (see :func:`_batch_encoder`), else
    ``None``."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or (
        cls.encode is not PreTrainedTokenizerBase.encode
        or cls._encode_plus is not TokenizersBackend._encode_plus
    ):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if bool(backend.encode_special_tokens) != bool(tokenizer.split_special_tokens):
        return None

    return backend


def _batch_encoder(tokenizer: Any) -> Callable[[list[str], bool], list[Any]] | None:
    """A function encoding a batch of texts with a Hugging Face fast tokenizer's backend, giving
    for each text an ``Encoding`` whose ``ids`` are exactly ``tokenizer.encode(text,
    add_special_tokens=...)`` (and whose ``len()`` is their number); ``None`` when that cannot
    be shown from the tokenizer (not a fast tokenizer, an ``encode`` overridden, truncation or
    padding set on the backend), and the source then encodes one record at a time.

    In transformers, a fast tokenizer's ``encode(text)`` is ``_encode_plus([text])``: it sets no
    truncation and no padding on the backend, sets ``encode_special_tokens`` to
    ``split_special_tokens``, calls ``backend.encode_batch([text], add_special_tokens=...)`` and
    returns that encoding's ids. The backend encodes every text of a batch on its own, so one
    ``encode_batch`` over many texts gives each text's ids (``encode_batch_fast`` where the
    backend has it: the same ids, without character offsets); it is used here only under the same
    conditions (checked once more on the first batch's records by the caller).
    """
    backend = _fast_backend(tokenizer)
    if backend is None:
        return None

    # encode_batch_fast: the same ids without computing character offsets (tokenizers >= 0.21)
    batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

    def encode(texts: list[str], add_special_tokens: bool) -> list[Any]:
        return batch(texts, add_special_tokens=add_special_tokens)

    return encode


@dataclass(frozen=True, slots=True)
class _LengthBound:
    """An upper bound on the number of tokens ``tokenizer.encode`` gives a text, from the
    tokenizer's structure (see :func:`_length_bound`): its UTF-8 bytes plus the special tokens
    the post-processor adds."""

    specials: int
    """Tokens the post-processor adds with ``add_special_tokens=True``."""
    ascii_only: bool
    """The tokenizer has a Unicode normalizer: only ASCII text (which every Unicode normal form
    leaves unchanged) is bounded."""
    absent: bytes = b""
    """Bytes the bound cannot count on for the one token: none when the vocabulary holds every
    byte symbol, else every non-ASCII byte and the ASCII bytes whose symbol it lacks (BPE drops
    those). A text needs one other byte."""

    def max_tokens(self, text: str, add_special_tokens: bool) -> int | None:
        """At least as many tokens as ``encode(text)`` gives, and that count is at least 1;
        ``None`` when no bound is known (empty text, a lone surrogate, non-ASCII text under a
        normalizer): encode it."""
        if not text or (self.ascii_only and not text.isascii()):
            return None
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: encode() fails and names the record
            return None
        if not data.translate(None, self.absent):  # maybe zero tokens: encode() decides
            return None
        return len(data) + (self.specials if add_special_tokens else 0)


_UNICODE_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")


def _length_bound(tokenizer: Any) -> _LengthBound | None:
    """A proven bound on ``tokenizer.encode``'s token counts, or ``None`` (then every prompt is
    tokenized to be counted).

    Shown for a tokenizer whose ``encode`` is its fast backend's (:func:`_batch_encoder`: no
    truncation or padding) with a byte-level pre-tokenizer (``ByteLevel``, no added prefix
    space), a BPE model, and no normalizer or a Unicode one (``NFC``/``NFD``/``NFKC``/``NFKD``,
    which leave ASCII text unchanged): GPT-2, SmolLM2, Qwen2 style. There, a text splits into
    added tokens (one token each, at least one character) and pieces whose bytes become one
    symbol each; BPE merges symbols and drops a symbol missing from its vocabulary (SmolLM2
    lacks a few control and non-UTF-8 bytes), so a piece gives at most its byte count in
    tokens, and at least one when it holds an ASCII byte whose symbol is a token. The
    post-processor then adds ``num_special_tokens_to_add`` tokens. So such a text gives between
    1 and ``len(text.encode("utf-8")) + specials`` tokens, and a source that keeps no ids need
    not encode a prompt whose bound is within the limit.
    """
    backend = _fast_backend(tokenizer)
    if backend is None:
        return None
    from tokenizers import models, pre_tokenizers  # installed with every fast tokenizer

    pre, model, norm = backend.pre_tokenizer, backend.model, backend.normalizer
    if not isinstance(pre, pre_tokenizers.ByteLevel) or pre.add_prefix_space:
        return None
    if not isinstance(model, models.BPE):
        return None
    if norm is not None and type(norm).__name__ not in _UNICODE_NORMALIZERS:
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    present = set()  # ASCII bytes whose one symbol is a token
    for b in range(0x80):
        pieces = pre.pre_tokenize_str(chr(b))
        if len(pieces) == 1 and pieces[0][0] in vocab:
            present.add(b)
    if not present:
        return None
    return _LengthBound(
        specials=int(backend.num_special_tokens_to_add(False)),
        ascii_only=norm is not None,
        absent=b""  # every byte's symbol is a token
        if all(sym in vocab for sym in pre_tokenizers.ByteLevel.alphabet())
        else bytes(b for b in range(0x100) if b not in present),
    )


class ParquetSource(FileSource):
    """Prompts from a Parquet file (extra ``rlpost-buffer[parquet]``: pyarrow). Errors name
    ``file:row N``."""

    @dataclass(kw_only=True, slots=True)
    class Config(SourceConfig):
        """Options of :class:`ParquetSource` (all from :class:`SourceConfig`)."""

    def __init__(self, config: SourceConfig, tokenizer: Tokenizer) -> None:
        super().__init__(config, tokenizer)

    def _read_records(self) -> list[tuple[int, str, Any, Any]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                "ParquetSource needs pyarrow: pip install 'rlpost-buffer[parquet]'."
            ) from None
        try:
            records = pq.read_table(self.file).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(f"{self.file}: not a readable Parquet file: {e}") from e
        rows = list(enumerate(records))[self._slice]
        return [(i, f"{self.file}:row {i}", rec, None) for i, rec in rows]


class HFDatasetSource(FileSource):
    """Prompts from a Hugging Face ``datasets`` dataset on local disk (extra
    ``rlpost-buffer[datasets]``).

    ``path`` is a directory written by ``Dataset.save_to_disk`` (or a ``DatasetDict``: pick the
    ``split``), or a local data file (``.json``/``.jsonl``/``.csv``/``.parquet``) loaded with
    ``datasets.load_dataset``. Nothing is downloaded.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(SourceConfig):
        """Options of :class:`HFDatasetSource`."""

        split: str = "train"
        """Split to read from a ``DatasetDict`` or a data file."""

    def __init__(self, config: SourceConfig, tokenizer: Tokenizer) -> None:
        super().__init__(config, tokenizer)

    def _read_records(self) -> list[tuple[int, str, Any, Any]]:
        try:
            import datasets
        except ImportError:
            raise ConfigError(
                "HFDatasetSource needs datasets: pip install 'rlpost-buffer[datasets]'."
            ) from None
        split = getattr(self.config, "split", "train")
        suffix = self.file.suffix.lstrip(".")
        try:
            if self.file.is_dir():
                ds = datasets.load_from_disk(str(self.file))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise ConfigError(
                            f"data_source.split: {split!r} not in {self.file} (splits: {list(ds)})."
                        )
                    ds = ds[split]
            else:
                kind = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}
                if suffix not in kind:
                    raise ConfigError(
                        f"data_source.path: {self.file} is neither a saved dataset directory nor "
                        "a .json/.jsonl/.csv/.parquet file."
                    )
                if kind[suffix] != "parquet":
                    _jsonl_lines(self.file)  # UTF-8 (pyarrow does not check): names file:line
                ds = datasets.load_dataset(kind[suffix], data_files=str(self.file), split=split)
            n = len(ds)
            idx = range(n)[self._slice]
            sub = ds.select(list(idx)) if len(idx) != n else ds
            return [(i, f"{self.file}:row {i}", rec, None) for i, rec in zip(idx, sub)]
        except RLError:
            raise
        except Exception as e:  # datasets, pyarrow and pandas raise many types for a bad file
            if self.file.is_dir():
                raise DataError(
                    f"{self.file}: not a dataset saved with save_to_disk ({type(e).__name__}: "
                    f"{e}). Point data_source.path at a saved dataset or a data file."
                ) from e
            lines = _jsonl_lines(self.file) if suffix in ("jsonl", "json", "csv") else [1]
            if not lines:
                raise DataError(
                    f"{self.file}: the file has no records; check data_source.path."
                ) from e
            if suffix == "jsonl":  # name the line at fault, if one is
                for lineno, line in lines:
                    where = f"{self.file}:{lineno}"
                    record = _parse_json(line.rstrip("\n"), where)
                    self._get(record, self.config.input_key, where, "input_key")
            raise DataError(
                f"{self.file}: datasets could not load it ({type(e).__name__}: {e}). Every "
                "record needs the same keys with the same types; or read a JSON-lines file "
                "with type: jsonl, which names the line at fault."
            ) from e


class MixtureSource(DataSource):
    """Several sources mixed by weight, with an exact cursor.

    Draw ``i`` picks its source from a block of choices seeded by ``(seed, i // block)``, so the
    mixture's state is its draw counter plus every child's cursor::

        mix = MixtureSource({"math": (math_src, 3.0), "code": (code_src, 1.0)}, seed=0)
        mix.next_prompts(8)        # ~6 math, ~2 code prompts, in a reproducible order

    ``len()`` is the sum of the children's lengths (one "epoch" of draws; not a permutation:
    children are sampled by weight and each cycles through its own epochs). Uids are
    ``f"{name}/{child}:{child_uid}"``.
    """

    _BLOCK = 1024

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`MixtureSource` (the children are built by the caller)."""

        seed: Seed = 0
        """Seed of the per-draw source choice."""
        name: str = "mix"
        """Prefix of the mixed prompts' uids (``f"{name}/{child}:{child_uid}"``), which keeps
        them unique even when children name their prompts alike."""

    def __init__(
        self,
        sources: Mapping[str, tuple[DataSource, float]],
        config: MixtureSource.Config | None = None,
        *,
        seed: int | None = None,
    ) -> None:
        if not sources:
            raise ConfigError("MixtureSource: no sources given.")
        self.config = config or MixtureSource.Config()
        if seed is not None:
            self.config.seed = seed
        self.names = list(sources)
        """Child names, in the order given."""
        self.sources = [sources[k][0] for k in self.names]
        w = np.array([float(sources[k][1]) for k in self.names])
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ConfigError(
                f"MixtureSource: weights must be finite, >= 0, and not all 0; got "
                f"{dict(zip(self.names, w.tolist()))}."
            )
        self.weights = w / w.sum()
        """Normalised weights."""
        self._draws = 0
        self._block_id = -1
        self._block: np.ndarray = np.empty(0, dtype=np.int64)
        self.counts = [0] * len(self.sources)
        """Prompts drawn from each child."""

    def _choice(self, i: int) -> int:
        b = i // self._BLOCK
        if b != self._block_id:
            rng = np.random.default_rng([self.config.seed, b])
            self._block = rng.choice(len(self.sources), size=self._BLOCK, p=self.weights)
            self._block_id = b
        return int(self._block[i % self._BLOCK])

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts; each is tagged ``metadata["mixture_source"]``."""
        if n < 0:
            raise ValueError(f"next_prompts: n must be >= 0, got {n}.")
        picks = [self._choice(self._draws + j) for j in range(n)]
        per: dict[int, list[Prompt]] = {}
        for k in sorted(set(picks)):
            per[k] = self.sources[k].next_prompts(picks.count(k))
        self._draws += n
        out = []
        pos = dict.fromkeys(per, 0)
        for k in picks:
            p = per[k][pos[k]]
            pos[k] += 1
            p.uid = f"{self.config.name}/{self.names[k]}:{p.uid}"
            p.metadata["mixture_source"] = self.names[k]
            out.append(p)
            self.counts[k] += 1
        return out

    def __len__(self) -> int:
        """Sum of the children's prompts per epoch."""
        return sum(len(s) for s in self.sources)

    def state_dict(self) -> dict[str, Any]:
        """Draw counter, per-child counts and every child's state."""
        return {
            "draws": self._draws,
            "names": list(self.names),
            "counts": list(self.counts),
            "sources": {k: s.state_dict() for k, s in zip(self.names, self.sources)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the draw counter and every child's cursor."""
        if "draws" not in state or "sources" not in state:
            raise CheckpointError("MixtureSource: state lacks 'draws'/'sources'.")
        if list(state.get("names", [])) != self.names:
            raise CheckpointError(
                f"MixtureSource: checkpoint mixes {state.get('names')}, this run mixes "
                f"{self.names}; use the same sources in the same order."
            )
        for k, s in zip(self.names, self.sources):
            s.load_state_dict(state["sources"][k])
        self._draws = int(state["draws"])
        self.counts = [int(c) for c in state["counts"]]
