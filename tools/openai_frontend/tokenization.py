"""The model's tokenizer, as the front door uses it: chat template, prompt tokens, and
text for the token ids a token-level model returns.

Owns: rendering chat messages with the tokenizer's chat template (or one given with
`--chat-template`), encoding prompts exactly as the repository's `preprocessing` does
(same tokenizer, same `add_special_tokens`), counting tokens, and decoding output ids
(`specdec.detokenizer`, the same exact incremental rule `postprocessing` uses).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from specdec.detokenizer import IncrementalDetokenizer

from .protocol import bad_field


class Tokenizer:
    def __init__(self, directory: str | Path, chat_template: Optional[str] = None,
                 add_special_tokens: bool = True, skip_special_tokens: bool = True):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.directory = str(directory)
        self.chat_template = chat_template
        self.add_special_tokens = add_special_tokens
        self.skip_special_tokens = skip_special_tokens
        # A chat template writes its own special tokens; a tokenizer that adds a BOS of its
        # own would add a second one (the text models' preprocessing always encodes with
        # `add_special_tokens`, so a rendered prompt drops its leading BOS text for them).
        bos = self.hf.bos_token
        self.adds_bos = bool(bos) and add_special_tokens and self.hf.encode("a")[:1] == [self.hf.bos_token_id]
        self.bos_text = bos if self.adds_bos else ""

    @property
    def eos_id(self) -> Optional[int]:
        return self.hf.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.hf, "chat_template", None))

    def chat_prompt(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opening (unless
        `add_generation_prompt` is false)."""
        if not self.has_chat_template:
            raise bad_field("messages", f"the tokenizer in {self.directory} has no chat template: use "
                                        f"/v1/completions, or start the front door with --chat-template FILE")
        try:
            return self.hf.apply_chat_template(list(messages), tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               chat_template=self.chat_template)
        except Exception as e:  # jinja2 errors, raise_exception() in a template (e.g. role order)
            raise bad_field("messages", f"the chat template refused them: {e}") from None

    def prompt_ids(self, prompt: str, templated: bool) -> list[int]:
        """Token ids of a prompt; a chat-templated prompt gets no special tokens added."""
        return self.hf.encode(prompt, add_special_tokens=self.add_special_tokens and not templated)

    def text_prompt(self, prompt: str, templated: bool) -> str:
        """The prompt for a text model, whose preprocessing adds special tokens itself."""
        if templated and self.bos_text and prompt.startswith(self.bos_text):
            return prompt[len(self.bos_text):]
        return prompt

    def count(self, text: str) -> int:
        """Tokens in generated text, re-encoded (text models return no token ids)."""
        return len(self.hf.encode(text, add_special_tokens=False)) if text else 0

    def encode_word(self, word: str) -> list[int]:
        return self.hf.encode(word, add_special_tokens=False)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer.from_tokenizer(self.hf, skip_special_tokens=self.skip_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as text, decoded as the output is (completions' echo of a token-id prompt)."""
        return self.hf.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        """A 400 on `param` for the first id outside the tokenizer's vocabulary."""
        vocab = len(self.hf)
        outside = next((t for t in ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise bad_field(param, f"token id {outside} is outside the tokenizer's vocabulary [0, {vocab})")

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

