"""Chat turns and generation defaults as a checkpoint releases them.

- The chat template of `tokenizer_config.json`, rendered with jinja2 in a sandbox as transformers renders it, with
  `add_generation_prompt` and `thinking` (Kimi K2.5 / K2.6's template reads it: thinking on unless it is false).
- `generation_config.json`: the stop ids (`eos_token_id`, one or a list) and the default temperature, top-p and
  top-k, applied to a request that sets none of its own (`do_sample: false` means greedy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from runner.sampling import SamplingParams

ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict]:
    """A chat: a non-empty list of {"role": system | user | assistant, "content": text}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content"}:
            raise ValueError(f"messages[{i}] must be an object with role and content, got {message!r:.80}")
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(message.get('content')).__name__}")
    return messages


def render_chat(template: str | None, messages, thinking: bool | None = None) -> str:
    """The prompt text of `messages` under the checkpoint's chat template, ready for the assistant's turn."""
    if not template:
        raise ValueError("the checkpoint's tokenizer_config.json has no chat_template; send text_input instead")
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return environment.from_string(template).render(
            messages=check_messages(messages), add_generation_prompt=True, thinking=thinking is not False
        )
    except TemplateError as err:
        raise ValueError(f"the chat template failed on these messages: {err}") from err


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that sets nothing gets: the release's stop ids and sampling settings."""

    end_ids: frozenset[int] = frozenset()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def load(cls, tokenizer_dir: Path, eos_token_id: int | None = None) -> GenerationDefaults:
        """From `tokenizer_dir/generation_config.json` (copied there by build-engine); the target config's
        eos_token_id where the file names no stop id."""
        path = Path(tokenizer_dir) / "generation_config.json"
        config = {}
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from err
        eos = config.get("eos_token_id", eos_token_id)
        end_ids = frozenset(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
        if config.get("do_sample") is False:
            return cls(end_ids, temperature=0.0)
        return cls(end_ids, config.get("temperature"), config.get("top_k"), config.get("top_p"))

    def sampling(self, temperature=None, top_k=None, top_p=None, seed: int = 0) -> tuple[SamplingParams, dict]:
        """The request's settings with the defaults filled in, and which defaults were used (said in the output)."""
        chosen, applied = {}, {}
        settings = [
            ("temperature", temperature, self.temperature, 0.0),
            ("top_k", top_k, self.top_k, 0),
            ("top_p", top_p, self.top_p, 1.0),
        ]
        for name, value, default, fallback in settings:
            if value is None and default is not None:
                chosen[name] = applied[name] = default
            else:
                chosen[name] = fallback if value is None else value
        params = SamplingParams(float(chosen["temperature"]), int(chosen["top_k"]), float(chosen["top_p"]), seed)
        return params, applied
