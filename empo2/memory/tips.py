"""Tip text: the request that makes the policy write a tip, the sanitiser, and the prompt block.

A tip is written by the policy itself, so it is untrusted text that later lands inside other
prompts. The sanitiser guarantees that a stored tip is one line of plain words that cannot close
its `<tip>` tag, open a chat turn, or smuggle in a special token; the block functions rely on that
guarantee to insert and remove tips exactly.
"""

from __future__ import annotations

import re
import unicodedata
import zlib
from collections.abc import Iterable, Mapping, Sequence

TIP_HEADER = "Here are some memories you collected in your previous exploration:"
TIP_OPEN = "<tip>"
TIP_CLOSE = "</tip>"

# Special tokens of the common chat templates (ChatML/Qwen, Llama 2/3, Mistral, Gemma, Phi).
# `<|...|>` covers the whole ChatML/Llama-3 family, so only the bracket-free forms are listed.
_BUILTIN_SPECIAL_TOKENS = (
    "<s>", "</s>", "<unk>", "<pad>", "<eos>", "<bos>",
    "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>",
    "<start_of_turn>", "<end_of_turn>",
)
_PIPE_TOKEN = re.compile(r"<\|[^<>|]{0,64}\|>")
# `< / tip >` with any spacing or case would still read as a tag to a model.
_TIP_TAG = re.compile(r"<\s*/?\s*tip\s*>", re.IGNORECASE)
_ROLE_PREFIX = re.compile(
    r"^\s*(?:#+\s*)?(?:system|user|assistant|human|tool|ai|bot)\s*:\s*", re.IGNORECASE
)
# Everything that ends a line for a renderer or a tokenizer, not just "\n".
_LINE_BREAKS = re.compile(r"\r\n|[\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
# A tip whose characters are more than this share non-printable is garbled output, not text.
_MAX_NONPRINTABLE_FRACTION = 0.1
# Degenerate repetition: "the the the ..." has few distinct words and compresses extremely well.
_MIN_DISTINCT_WORD_RATIO = 0.3
_MIN_WORDS_FOR_RATIO = 8
_MIN_COMPRESSION_RATIO = 0.2
_MIN_CHARS_FOR_COMPRESSION = 100


def tip_request_message(max_words: int = 100) -> dict[str, str]:
    """The user turn appended after an episode's chat asking the policy to write its tip."""
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    return {
        "role": "user",
        "content": (
            "The episode is over. In one line of at most "
            f"{max_words} words, summarise what happened in this episode, what you learned, "
            "and how far the task is from being completed. Reply with that line only."
        ),
    }


def _is_nonprintable(ch: str) -> bool:
    # Cc (controls), Cf (zero-width and bidi marks), Co (private use), Cs (surrogates), Cn (unassigned).
    return unicodedata.category(ch)[0] == "C"


def _strip_tokens(text: str, special_tokens: Sequence[str]) -> str:
    """Removes special tokens and tip tags until none is left.

    Removal repeats to a fixed point because taking one token out can join its neighbours into a
    new one (`<ti<tip>p>` becomes `<tip>`). Each removal leaves a space, which both separates the
    neighbours and shrinks nothing into a token on the next pass.
    """
    lowered = [t.lower() for t in special_tokens if t]
    while True:
        before = text
        text = _PIPE_TOKEN.sub(" ", text)
        text = _TIP_TAG.sub(" ", text)
        for token in lowered:
            text = re.sub(re.escape(token), " ", text, flags=re.IGNORECASE)
        if text == before:
            return text


def _strip_role_prefixes(line: str) -> str:
    # "user: assistant: ..." chains are stripped one marker at a time.
    while True:
        stripped = _ROLE_PREFIX.sub("", line, count=1)
        if stripped == line:
            return line
        line = stripped


def _is_degenerate(words: list[str], text: str) -> bool:
    if not any(ch.isalnum() for ch in text):
        return True
    if len(words) >= _MIN_WORDS_FOR_RATIO:
        distinct = len({w.lower() for w in words})
        if distinct / len(words) < _MIN_DISTINCT_WORD_RATIO:
            return True
    if len(text) >= _MIN_CHARS_FOR_COMPRESSION:
        raw = text.encode("utf-8")
        if len(zlib.compress(raw, 9)) / len(raw) < _MIN_COMPRESSION_RATIO:
            return True
    return False


def clean_line(text: str, special_tokens: Iterable[str] = ()) -> str:
    """Normalises text to one plain line: no special tokens, tip tags, role markers or line breaks.

    Used for the tip itself and for other untrusted pieces of an entry (an environment action).
    """
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    tokens = tuple(_BUILTIN_SPECIAL_TOKENS) + tuple(special_tokens)
    # NFKC folds look-alikes such as full-width `＜｜im_start｜＞` into the ASCII token.
    text = unicodedata.normalize("NFKC", text)
    text = _LINE_BREAKS.sub("\n", text)
    text = "".join(" " if ch == "\t" else ch for ch in text if ch in "\n\t" or not _is_nonprintable(ch))
    text = _strip_tokens(text, tokens)
    lines = [_strip_role_prefixes(line) for line in text.split("\n")]
    # Stripping a role marker can expose a token split across it; one more pass closes that gap.
    text = _strip_tokens(" ".join(lines), tokens)
    return " ".join(_strip_role_prefixes(text).split())


def sanitize_tip(text: str, max_words: int = 100, special_tokens: Iterable[str] = ()) -> str | None:
    """Makes policy-written tip text safe to store and to put inside a `<tip>` tag.

    Removes chat-template special tokens (built-in list plus `special_tokens`, e.g. a tokenizer's
    `all_special_tokens`), tip tags and leading role markers, collapses all whitespace to single
    spaces and keeps the first `max_words` words. Returns None for text that should not become a
    tip: empty after cleaning, mostly non-printable, or degenerate repetition.
    """
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    if not isinstance(text, str):
        raise TypeError(f"tip text must be str, got {type(text).__name__}")
    visible = [ch for ch in text if not ch.isspace()]
    if not visible:
        return None
    if sum(_is_nonprintable(ch) for ch in visible) / len(visible) > _MAX_NONPRINTABLE_FRACTION:
        return None
    words = clean_line(text, special_tokens).split()[:max_words]
    tip = " ".join(words)
    if not tip or _is_degenerate(words, tip):
        return None
    return tip


def step_entry_text(tip: str, action: str, score: float) -> str:
    """One per-step memory entry in the released code's format (tip, the step's action, final score)."""
    action = clean_line(action)
    score_text = f"{score:g}" if isinstance(score, float) else str(score)
    return f"{tip}; at that timestep the action taken was {action}; final score {score_text}/100"


# The released code's wording (microsoft/agent-lightning 0b40cb72, contrib/recipes/envs/add_instruction.py:18-24 and
# contrib/agentlightning/contrib/agent/empo2_agent.py:140-142, 209-220, 244-246), for `rollout.prompt_template=released`
# and `memory.tip_format=raw`: raw tips, possibly several lines, so only the token-level spans of `PromptBuilder`
# (never a text pattern) locate and remove them.
RELEASED_TIP_INSTRUCTION = (
    "Thanks for playing.\n"
    "Now you have ended a trajectory and collect some meaningless or valuable information from the interactions "
    "with the environment.\n"
    "Please summarize the trajectory, and also summarize what information you get from this trajectory, and how "
    "far this trajectory is from fully completing the task.\n"
    "Please respond with only one sentence with only one line, do not include any extra words.\n"
    "Your sentence should be less than 100 words."
)


def released_memories_text(tips: Sequence[str]) -> str:
    """The retrieved entries as the released agent lists them: the header line, then each entry and a newline."""
    return TIP_HEADER + "\n" + "".join(tip + "\n" for tip in tips) if tips else ""


def released_tip_block(tips: Sequence[str]) -> str:
    """One turn's tips in the released prompt (`add_chat_all_tips`): the memories inside one `<tip>` tag."""
    return f"\n\n<tip> {released_memories_text(tips)}\n</tip>\n\n" if tips else ""


def released_step_entry_text(tip: str, action: str, episode_return: float, max_score: float = 100.0) -> str:
    """One per-step memory entry in the released wording: the raw tip, the step's raw action, the episode's
    return rounded to 0.1 (a float, as Python prints it) out of `max_score` (100 x its reward scale)."""
    return (f"{tip}; At that timestep, the specific action your took was {action}; Eventually you got the score "
            f"{round(float(episode_return), 1)}/{int(max_score)}.")


def episode_entries(
    tip: str,
    meta: Mapping[str, object],
    per_step: bool = False,
    actions: Sequence[str] = (),
    score: float | None = None,
    released: bool = False,
) -> tuple[list[str], list[dict[str, object]]]:
    """Memory entries (texts, metas) for one episode's sanitised tip (raw with `released`).

    Per-episode (default): one entry, the tip itself, with `meta`. Per-step: one entry per action
    `step_entry_text(tip, actions[t], score)` whose meta adds `step=t` and `action=actions[t]`;
    `score` defaults to `meta["episode_return"]`. With `released` the entries use `released_step_entry_text`
    and the raw actions. The caller embeds each entry's key text.
    """
    if not per_step:
        return [tip], [dict(meta)]
    if score is None:
        if "episode_return" not in meta:
            raise ValueError("per-step entries need a score or meta['episode_return']")
        score = meta["episode_return"]  # type: ignore[assignment]
    texts, metas = [], []
    for t, action in enumerate(actions):
        texts.append(released_step_entry_text(tip, action, score) if released  # type: ignore[arg-type]
                     else step_entry_text(tip, action, score))  # type: ignore[arg-type]
        metas.append({**meta, "step": t, "action": action if released else clean_line(action)})
    return texts, metas


def check_tip_line(tip: str) -> None:
    """Raises ValueError when `tip` could break out of its `<tip>` line (not sanitised)."""
    if not isinstance(tip, str):
        raise TypeError(f"tip must be str, got {type(tip).__name__}")
    if not tip.strip():
        raise ValueError("tip is empty")
    if _LINE_BREAKS.search(tip) or _TIP_TAG.search(tip):
        raise ValueError(f"tip contains a line break or a tip tag; pass it through sanitize_tip: {tip!r}")


def format_tip_block(tips: Sequence[str]) -> str:
    """The prompt block for retrieved tips: TIP_HEADER, then one `<tip>...</tip>` per line.

    Every line of the block, the last included, ends with "\\n", so inserting the block at the
    start of a line and `strip_tip_block` give back the tip-free text exactly. No tips, no block
    (the empty string).
    """
    if not tips:
        return ""
    for tip in tips:
        check_tip_line(tip)
    return TIP_HEADER + "\n" + "".join(f"{TIP_OPEN}{tip}{TIP_CLOSE}\n" for tip in tips)


_BLOCK = re.compile(
    r"(?m)^" + re.escape(TIP_HEADER) + r"\n(?:" + re.escape(TIP_OPEN) + r"[^\n]*?" + re.escape(TIP_CLOSE) + r"\n)+"
)


def strip_tip_block(text: str) -> str:
    """Removes every block that `format_tip_block` inserted, and nothing else."""
    return _BLOCK.sub("", text)
