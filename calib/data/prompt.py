"""The prompt record every data source produces, and how a question becomes model input.

:class:`PromptFormatter` is the one place that knows about chat templates and BOS tokens:

- without a chat template the text is ``{context}\\n\\nQuestion: {question}\\nAnswer: {prefix}``;
- with one, ``{context}\\n\\nQuestion: {question}`` is the user message, the template's generation
  prompt follows, and the answer prefix starts the assistant's reply (as RULER does);
- ``input_ids`` hold the tokenizer's BOS exactly once when the tokenizer uses one (by default or in
  its chat template), and none otherwise; a BOS written by the template into the text is not doubled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from calib.errors import UserError


@dataclass
class Prompt:
    """One prompt: ``text`` is what the model reads, ``answer`` the expected completion.

    ``text`` is the final string (chat template applied if any); ``input_ids`` are the tokenizer's ids
    of ``text`` with BOS exactly once; ``answer`` is whitespace-stripped (``""``: the row has none);
    ``length`` is the target length in tokens (for synthetic prompts ``len(input_ids) <= length``; for
    file/hub prompts the row's ``length`` field, else the actual token count); ``scoring`` is the task's
    rule, ``exact_match`` or ``contains`` (score with :func:`calib.data.is_correct`).
    """

    prompt_id: str
    task: str
    length: int
    text: str
    answer: str
    input_ids: list[int]
    scoring: str = "exact_match"


class PromptFormatter:
    """Turns (context, question, answer prefix) into text and ids for one tokenizer."""

    def __init__(self, tokenizer, chat_template: bool | None = None) -> None:
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise UserError("data.chat_template=true but the tokenizer has no chat template; "
                            "set data.chat_template=null (auto) or false")
        self.use_chat = has_template if chat_template is None else bool(chat_template)
        self.bos_id = getattr(tokenizer, "bos_token_id", None)
        self.add_bos = self.bos_id is not None and self._uses_bos()

    def _uses_bos(self) -> bool:
        probe = list(self.tokenizer("a", add_special_tokens=True)["input_ids"])
        if probe and probe[0] == self.bos_id:
            return True
        if self.use_chat:
            rendered = self.render("a", "b", "")
            bos_text = self.tokenizer.bos_token
            return bool(bos_text) and rendered.startswith(bos_text)
        return False

    def render(self, context: str, question: str, prefix: str) -> str:
        """The model's input text (no BOS added here unless the chat template writes one)."""
        if not self.use_chat:
            return f"{context}\n\nQuestion: {question}\nAnswer: {prefix}"
        messages = [{"role": "user", "content": f"{context}\n\nQuestion: {question}"}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + prefix

    def wrap_user_text(self, user_text: str) -> str:
        """A raw prompt (JSONL/HF rows) as model input: chat-templated when a template is in use."""
        if not self.use_chat:
            return user_text
        messages = [{"role": "user", "content": user_text}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with BOS exactly once (when the tokenizer uses BOS). Quietly: prompt
        fitting measures texts longer than the model's context before trimming them, which transformers
        would otherwise report as a sequence "too long for this model" it never runs."""
        ids = list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if self.add_bos:
            start = 0
            while start < len(ids) and ids[start] == self.bos_id:
                start += 1
            ids = [self.bos_id] + ids[start:]
        return ids


_OPENERS = "\"'([{"  # an answer right after one of these follows it with no space (kv_retrieval's `"key": "`)


def answer_token_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """``prompt.answer`` (the gold answer) as the tokens the model emits after ``prompt.input_ids``.

    The synthetic tasks' completions are the answer after one space (``" 1234567"`` after "... is",
    also a chat model's reply prefix ``… The special magic number for lana is``), or with no separator
    when the prompt already ends with whitespace or an opening quote/bracket (the kv_retrieval prefix
    ``"key": "``); ``scripts/train_tiny.py`` tokenizes exactly that completion alone (no BOS), and
    greedy decoding appends tokens one by one, so this is what the model sees. Glued to the prompt's
    last word (``is8914861``), the digits would be a continuation no model writes. Empty answers give
    no tokens. SAAP's teacher-forced targets and SampleAttention's answer probability both use it.
    """
    answer, text = str(prompt.answer), str(prompt.text)
    if not answer:
        return []
    sep = "" if not text or text[-1].isspace() or text[-1] in _OPENERS else " "
    return list(tokenizer(sep + answer, add_special_tokens=False)["input_ids"])
