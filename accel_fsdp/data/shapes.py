"""The shapes public datasets come in, read as their peers read them (TRL, axolotl, LLaMA-Factory): ShareGPT's
conversations, and preference pairs whose prompt is the start both answers share (Anthropic's HH-RLHF).

Each rule here applies only to rows that would otherwise be refused, so every row that was read before reads as it
did (the same tables, byte for byte). This module must never read a file or report a problem itself: it answers
what a row holds, or the words of what is wrong with it, and data/tokenize.py records them with the row's line.
"""

from __future__ import annotations

import os

from accel_fsdp.config.recipe import DataConfig, SourceConfig

SHAREGPT_FIELD = "conversations"
"""The column of ShareGPT's rows, read when the source's messages_field is the default and the row has none."""
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
"""ShareGPT's `from` -> the role (axolotl's and LLaMA-Factory's sharegpt readers map them so). The raw ShareGPT dumps
name the answering chatbot (chatgpt, bing, bard), which FastChat's cleaning reads as gpt. Any other `from`
(function_call, observation, tool) stays as written, and the chat check names it as it names any role."""


def chat_field(row: dict, source: SourceConfig) -> str:
    """The column of a chat row's messages: the source's messages_field, or ShareGPT's `conversations` when the
    messages_field is the default (`messages`) and the row has that column instead. A field the user named is read
    as named: missing, it is named as missing."""
    field = source.messages_field
    if field not in row and field == DataConfig.messages_field and SHAREGPT_FIELD in row:
        return SHAREGPT_FIELD
    return field


def prompt_left_out(row: dict, source: SourceConfig) -> bool:
    """Whether a preference row leaves its prompt to be read from elsewhere (ShareGPT's conversations, or the start
    its answers share): it has no prompt column, and the source's prompt_field is the default. A field the user named
    is read as named, and a row without it is refused."""
    return source.prompt_field not in row and source.prompt_field == DataConfig.prompt_field


def prompt_field(row: dict, source: SourceConfig) -> str:
    """The column of a preference row's prompt: the source's prompt_field, or ShareGPT's `conversations` when the
    prompt_field is the default and the row has that column instead and a message (or a list) as an answer
    (LLaMA-Factory's ShareGPT pairs: the conversation, then one message each). A field the user named is read as
    named."""
    answers = (row.get(source.chosen_field), row.get(source.rejected_field))
    if (prompt_left_out(row, source) and isinstance(row.get(SHAREGPT_FIELD), list)
            and any(isinstance(a, (dict, list)) for a in answers)):
        return SHAREGPT_FIELD
    return source.prompt_field


def as_messages(value):
    """(messages, problem): a message list in {role, content} form, ShareGPT's {from, value} messages read as such
    (role from `from`, mapped by SHAREGPT_ROLES; content from `value`; any other key kept). Anything else is returned
    as it is, for the chat check to judge; problem: a list that mixes the two forms, or a {from} message without a
    value."""
    if not isinstance(value, list):
        return value, None
    # A key holding null is a key left out: a Parquet column of messages has every key any of its messages has.
    sharegpt = [j for j, m in enumerate(value) if isinstance(m, dict) and m.get("from") is not None
                and m.get("role") is None]
    if not sharegpt:
        return value, None
    if len(sharegpt) < len(value):
        other = next(j for j in range(len(value)) if j not in set(sharegpt))
        return None, (f"message {sharegpt[0] + 1} is ShareGPT's {{from, value}} form and message {other + 1} is not "
                      "(a conversation is read in one form)")
    out = []
    for j, m in enumerate(value):
        if "value" not in m:
            return None, (f"message {j + 1} is ShareGPT's form without a value (its keys: "
                          f"{', '.join(map(str, m))})")
        rest = {k: v for k, v in m.items() if k not in ("from", "value", "role", "content")}
        out.append({"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"], **rest})
    return out, None


def implicit_prompt(chosen: str, rejected: str) -> tuple[int, str | None]:
    """(where the answers start, problem) of a pair of texts without a prompt field, by TRL's rule
    (trl/data_utils.py `extract_prompt`): the prompt is the longest common prefix of the two texts, in characters,
    less a space it ends with (that space starts both answers: HH-RLHF's "...\\n\\nAssistant:" is the prompt, " Sure"
    an answer). A prefix that is empty (or whitespace) or the whole of an answer leaves no prompt or no answer."""
    start = len(os.path.commonprefix([chosen, rejected]))
    if start == min(len(chosen), len(rejected)):
        return 0, ("chosen and rejected are equal, or one is the start of the other, so no answer is left after the "
                   "prompt they share")
    if start and chosen[start - 1] == " ":
        start -= 1
    if not chosen[:start].strip():
        return 0, "chosen and rejected share no text at their start, so no prompt can be read from them"
    return start, None
