"""Turning untrusted model text into an environment action (shared by every environment).

The released EMPO² code replaces an invalid action by the valid action with the highest
word-level Jaccard overlap; we do the same when `correction` is on. Nothing here may raise on
model output: empty strings, 10k characters, control bytes and special tokens all map to either
a valid action or an explicit invalid one.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(r"^\s*(?:>+\s*)?(?:(?:next\s+)?action|command|act)\s*[:：\-]\s*", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_QUOTES = "\"'`“”‘’*"
MAX_ACTION_CHARS = 200  # no valid action in any of our environments is longer


def parse_action(text: str) -> str:
    """First non-empty line of `text`, without control bytes, quotes, "Action:" prefixes or case."""
    if not isinstance(text, str):
        text = str(text)
    # Lone surrogates (bytes decoded with errors="surrogateescape") cannot be encoded as UTF-8, which is
    # what py4j sends to the ScienceWorld JVM: one would fail the call and the episode. They become U+FFFD.
    text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    text = _CONTROL.sub(" ", text.replace("\r", "\n"))
    line = next((ln for ln in text.split("\n") if ln.strip()), "")
    line = _PREFIX.sub("", line.strip())
    line = line.strip().strip(_QUOTES).strip().rstrip(".").strip()
    return " ".join(line.split())[:MAX_ACTION_CHARS].lower()


def _words(s: str) -> set[str]:
    return set(s.lower().split())


def jaccard(a: str, b: str) -> float:
    wa, wb = _words(a), _words(b)
    if not wa and not wb:
        return 0.0
    return len(wa & wb) / len(wa | wb)


def correct_action(action: str, valid: list[str]) -> str | None:
    """The valid action with the highest word-level Jaccard overlap (first one on ties); None when
    nothing overlaps at all, so an empty or garbage action stays invalid rather than becoming an
    arbitrary move."""
    best, best_score = None, 0.0
    for cand in valid:
        s = jaccard(action, cand)
        if s > best_score:
            best, best_score = cand, s
    return best


def resolve_action(text: str, valid: list[str] | None, correction: bool) -> tuple[str | None, dict]:
    """Map model text to an action. `valid=None` means the environment can check the action itself
    (the fast path: valid actions are only computed when correction needs them).

    Returns (action or None when invalid, info) with info keys `parsed_action`, `corrected` and
    `invalid_action`.
    """
    action = parse_action(text)
    info = {"parsed_action": action, "corrected": False, "invalid_action": False}
    if valid is None:
        return (action or None), info
    if action in valid:
        return action, info
    if correction and action:
        fixed = correct_action(action, valid)
        if fixed is not None:
            info["corrected"] = True
            return fixed, info
    info["invalid_action"] = True
    return None, info
