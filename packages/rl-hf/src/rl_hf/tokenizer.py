"""A tokenizer built locally (no downloads) for tests, demos and the tiny reference models.

Byte-level, no merges: ids 0..255 are the 256 ``ByteLevel`` alphabet symbols (one per byte, so
any UTF-8 text round-trips exactly), followed by four special tokens::

    256 <|endoftext|>   257 <|im_start|>   258 <|im_end|> (eos)   259 <|pad|> (pad)

It carries a ChatML chat template, so ``apply_chat_template(messages, add_generation_prompt=True)``
works as with Qwen-style models::

    tok = build_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2="}],
                                  add_generation_prompt=True, tokenize=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "SPECIAL_TOKENS", "VOCAB_SIZE", "build_tokenizer"]

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
"""Special tokens, in id order after the 256 byte symbols."""

VOCAB_SIZE: int = 256 + len(SPECIAL_TOKENS)
"""Number of token ids the tokenizer produces (260)."""

CHATML_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML Jinja template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, plus
``<|im_start|>assistant\\n`` when a generation prompt is asked for."""


def build_tokenizer(save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the byte-level ChatML tokenizer described in the module docstring.

    Deterministic: the same ids on every call and machine. ``decode(encode(x)) == x`` for any
    text without special-token strings in it.

    Args:
        save_dir: if given, the tokenizer is also written there with ``save_pretrained`` (so
            ``AutoTokenizer.from_pretrained(save_dir)`` loads it).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with ``eos_token="<|im_end|>"``,
        ``pad_token="<|pad|>"`` and ``padding_side="left"``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable unicode symbol; order ids by byte value so id == byte.
    byte_to_symbol = _bytes_to_unicode()
    vocab = {byte_to_symbol[b]: b for b in range(256)}
    if set(vocab) != set(alphabet):  # pragma: no cover - guards a tokenizers change
        raise RuntimeError("tokenizers' ByteLevel alphabet changed; update build_tokenizer.")
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    # Vocabulary already holds the special tokens; registering them makes them atomic.
    core.add_special_tokens(list(SPECIAL_TOKENS))

    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tok.chat_template = CHATML_TEMPLATE
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(save_dir))
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map, which ``ByteLevel`` uses."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}
