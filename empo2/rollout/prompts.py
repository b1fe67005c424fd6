"""Chat prompts for the policy: system and task text, past observation/action turns, optional tips.

Layout (one chat, rendered by the tokenizer's own template):

    system     the system prompt
    user       the task description
    user       observation_0 [+ tips] ┐ one pair per kept past turn, oldest first; a history turn
    assistant  action_0               ┘ keeps its tip block only with `history_tips` (released code)
    ...
    user       current observation [+ "\\n\\n" + tip block]
    <generation prompt>

Untrusted text (task, observations, actions, tips) must never become a special token, so the chat
template is rendered once per message layout with placeholder slots instead of contents. The
rendered string is cut at the slots: template pieces are tokenized normally (their special tokens
are real), contents with `split_special_tokens=True` (an "<|im_start|>" inside an observation is
plain text). The ids are the concatenation of both. Since each tip block is a content piece of its
own, its span is known exactly and removing them gives, token for token, the tip-free prompt.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from empo2.memory.tips import (
    RELEASED_TIP_INSTRUCTION,
    format_tip_block,
    released_memories_text,
    released_tip_block,
    tip_request_message,
)

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent acting in a text environment. Each user message shows what you observe. "
    "Reply with exactly one action on a single line, and nothing else."
)
# Private-use code points: no chat template emits them, and a `trim` filter leaves them alone.
_SLOT = "\ue000{}\ue001"
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")
_MERGE_SEPARATOR = "\n\n"  # joins contents that share one message in the fallback layout
_TIP_SEPARATOR = "\n\n"  # between the observation and the tip block; part of the tip span
TEMPLATES = ("project", "released")
# The released code's exploration instruction, appended after "\n\n" to the last user message of every action
# prompt (microsoft/agent-lightning 0b40cb72, contrib/recipes/envs/add_instruction.py:13-16, 80-82).
RELEASED_NAIVE_INSTRUCTION = (
    "You could try to explore different actions, especially when you are not sure what the best action for your "
    "current observation.\n"
    "Please response with only one line with one sentence, following the possible action format shown above. No "
    "extra words are allowed."
)


@dataclass
class Prompt:
    """Token ids of one behaviour prompt.

    ids: the prompt, ending with the template's generation prompt (assistant header).
    tip_spans: [start, end) of each tip block's tokens inside `ids`, in order (empty without tips).
    prefix_len: where the task text ends: `ids[:prefix_len]` is the system and task part, the same with or
        without tips, which every prompt of one task shares (0: no task piece).
    """

    ids: list[int]
    tip_spans: list[tuple[int, int]] = field(default_factory=list)
    prefix_len: int = 0

    @property
    def has_tips(self) -> bool:
        return bool(self.tip_spans)

    def without_tips(self) -> list[int]:
        """The same prompt with every tip block cut out: exactly what `build` returns without tips."""
        out, pos = [], 0
        for start, end in self.tip_spans:
            out += self.ids[pos:start]
            pos = end
        return out + self.ids[pos:]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered slot by slot."""


# One content piece of a message: (kind, token ids). kind "task" | "current" | "tip" | "text" tells
# truncation which piece it may cut and `_join` where the tip span lies.
_Piece = tuple[str, tuple[int, ...]]
_Message = tuple[str, list[_Piece]]


class PromptBuilder:
    """Builds policy prompts as token ids, within a token budget.

    max_prompt_tokens bounds the tip-free prompt. The tip block comes on top of it, so a prompt and
    its tip-free twin always keep the same history turns (the budget cannot depend on the tips).
    Truncation drops the oldest (observation, action) pairs first; the system and task messages stay.
    If even the prompt without past turns is too long, the current observation is cut (its end is
    kept), then the task text (its start is kept).
    history_turns: keep at most this many past turns (None: as many as fit).
    max_request_tokens: the budget of the tip request, which shows the whole episode (None: the same as
        max_prompt_tokens).
    Contents are stripped of surrounding whitespace.
    template: `project` (the layout above) or `released`, the released code's chat (its
    `HistoryPromptBuilder.get_chat_prompt`, `add_chat_all_tips`, `add_chat_instruction`): no system
    message; the task text follows the first observation after "\n" (that message is never dropped,
    truncation drops the turns after it); a turn's tips come as one block "\n\n<tip> " + header +
    one line per memory + "\n</tip>\n\n" (the tip span); every action prompt ends with "\n\n" and
    `RELEASED_NAIVE_INSTRUCTION`; the tip request shows each turn's memories without tags and asks with
    `RELEASED_TIP_INSTRUCTION`. Contents are kept as they are (not stripped).
    """

    def __init__(self, tokenizer, system_prompt: str | None = None, max_prompt_tokens: int = 4500,
                 history_turns: int | None = None, max_request_tokens: int | None = None, template: str = "project"):
        if template not in TEMPLATES:
            raise ValueError(f"unknown prompt template {template!r}; expected one of {TEMPLATES}")
        if max_prompt_tokens < 1 or (max_request_tokens is not None and max_request_tokens < 1):
            raise ValueError(f"max_prompt_tokens and max_request_tokens must be >= 1, got {max_prompt_tokens} "
                             f"and {max_request_tokens}")
        if history_turns is not None and history_turns < 0:
            raise ValueError(f"history_turns must be >= 0 or None, got {history_turns}")
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        if template == "released":
            self.system_prompt = ""  # the released chat has no system message
        self.max_prompt_tokens = max_prompt_tokens
        self.max_request_tokens = max_request_tokens or max_prompt_tokens
        self.history_turns = history_turns
        # The collector passes the same observation strings at every later step of an episode, and a
        # str caches its own hash, so each text is tokenized once and looked up in O(1) afterwards.
        self._encode = functools.lru_cache(maxsize=16384)(self._encode_uncached)
        self._template_cache: dict[tuple, list[list[int]]] = {}
        self._merge = not self._template_accepts_layout()
        self._check_content_encoding()

    # ------------------------------------------------------------------------------------------ public
    def build(self, task_description: str, history: list[tuple[str, str]], observation: str,
              tips: list[str] | None = None, history_tips: list[list[str] | None] | None = None) -> Prompt:
        """The prompt for the next action. history: past (observation, action) turns, oldest first;
        history_tips: the tips each past turn's prompt carried (one entry per turn, None for none), kept
        in those turns."""
        return self._assemble(task_description, history, [observation], tips, history_tips, all_turns=False)

    def build_tip_request(self, task_description: str, history: list[tuple[str, str]],
                          final_observation: str, max_words: int = 100,
                          history_tips: list[list[str] | None] | None = None) -> list[int]:
        """The whole episode chat (every turn, whatever `history_turns` says, within the token budget) plus
        one more user turn asking the policy for its tip; tip-free unless `history_tips` is given."""
        request = RELEASED_TIP_INSTRUCTION if self.template == "released" else tip_request_message(max_words)["content"]
        return self._assemble(task_description, history, [final_observation, request], None, history_tips,
                              all_turns=True).ids

    def tips_that_fit(self, tips: list[str], max_tokens: int | None) -> int:
        """How many of the leading `tips` an action prompt's tip block holds within `max_tokens` (None: all)."""
        n = len(tips)
        while n and max_tokens is not None and len(self._tip_piece(tips[:n])[0][1]) > max_tokens:
            n -= 1
        return n

    # -------------------------------------------------------------------------------------- assembling
    def _tip_piece(self, tips: list[str] | None, request: bool = False) -> list[_Piece]:
        if not tips:
            return []
        if self.template == "released":  # the tip request lists a turn's memories without tags
            return ([("text", self._encode(released_memories_text(tips), False))] if request else
                    [("tip", self._encode(released_tip_block(tips), False))])
        return [("tip", self._encode(_TIP_SEPARATOR + format_tip_block(tips), False))]

    def _assemble(self, task: str, history: list[tuple[str, str]], tail_users: list[str],
                  tips: list[str] | None, history_tips: list[list[str] | None] | None, all_turns: bool) -> Prompt:
        released = self.template == "released"
        enc = functools.partial(self._encode, strip=not released)
        if history_tips is None:
            history_tips = [None] * len(history)
        if len(history_tips) != len(history):
            raise ValueError(f"history_tips needs one entry per history turn: {len(history_tips)} for {len(history)}")
        if self.history_turns is not None and not all_turns:
            keep = self.history_turns
            history, history_tips = (history[-keep:], history_tips[-keep:]) if keep else ([], [])
        head: list[_Message] = [("system", [("text", enc(self.system_prompt))])] if self.system_prompt else []
        turns: list[_Message] = []
        for (obs, action), turn_tips in zip(history, history_tips):
            turns += [("user", [("text", enc(obs))] + self._tip_piece(turn_tips, request=all_turns and released)),
                      ("assistant", [("text", enc(action))])]
        tip = self._tip_piece(tips)
        extra: list[_Message] = [("user", [("text", enc(t))]) for t in tail_users[1:]]
        # released: every action prompt ends with the exploration instruction (the tip request does not)
        naive = [] if all_turns or not released else [("text", enc(_TIP_SEPARATOR + RELEASED_NAIVE_INSTRUCTION))]

        def messages(first_turn: int, task_ids: tuple[int, ...], current_ids: tuple[int, ...]) -> list[_Message]:
            if released:  # the task text follows the first observation, whose message always stays
                instruction = [("task", task_ids)]
                if not turns:
                    msgs = [("user", [("current", current_ids)] + instruction + tip + naive)] + extra
                else:
                    (role, pieces), answer = turns[0], turns[1]
                    msgs = ([(role, pieces[:1] + instruction + pieces[1:]), answer] + turns[2 * max(first_turn, 1):]
                            + [("user", [("current", current_ids)] + tip + naive)] + extra)
            else:
                msgs = (head + [("user", [("task", task_ids)])] + turns[2 * first_turn:]
                        + [("user", [("current", current_ids)] + tip)] + extra)
            return self._merged(msgs) if self._merge else msgs

        task_ids, current_ids = enc(("\n" + task) if released else task), enc(tail_users[0])
        budget = self.max_request_tokens if all_turns else self.max_prompt_tokens
        n = len(history)
        # Fewest dropped turns that fit; the length only shrinks as turns are dropped (binary search).
        if self._free_length(messages(0, task_ids, current_ids)) <= budget:
            return self._join(messages(0, task_ids, current_ids))
        over = self._free_length(messages(n, task_ids, current_ids)) - budget
        if over <= 0:
            lo, hi = 1, n  # messages(hi) fits, messages(lo - 1) does not
            while lo < hi:
                mid = (lo + hi) // 2
                if self._free_length(messages(mid, task_ids, current_ids)) <= budget:
                    hi = mid
                else:
                    lo = mid + 1
            return self._join(messages(lo, task_ids, current_ids))
        # No past turn left and still too long: cut the current observation, then the task text.
        cut = min(over, len(current_ids))
        current_ids = current_ids[cut:]
        task_ids = task_ids[:len(task_ids) - min(over - cut, len(task_ids))]
        msgs = messages(n, task_ids, current_ids)
        if self._free_length(msgs) > budget:
            name = "max_request_tokens" if all_turns else "max_prompt_tokens"
            raise ValueError(f"{name}={budget} cannot hold even the system prompt and the chat template's own "
                             f"tokens")
        return self._join(msgs)

    def _merged(self, msgs: list[_Message]) -> list[_Message]:
        """Fallback layout: the system text becomes user text and neighbours of one role share a message."""
        sep = ("text", self._encode(_MERGE_SEPARATOR, False))
        out: list[_Message] = []
        for role, pieces in msgs:
            role = "user" if role == "system" else role
            if out and out[-1][0] == role:
                out[-1] = (role, out[-1][1] + [sep] + pieces)
            else:
                out.append((role, pieces))
        return out

    def _free_length(self, msgs: list[_Message]) -> int:
        """Token count of the prompt without its tip block."""
        template = self._template_pieces(tuple((role, len(pieces)) for role, pieces in msgs))
        return (sum(len(t) for t in template)
                + sum(len(ids) for _, pieces in msgs for kind, ids in pieces if kind != "tip"))

    def _join(self, msgs: list[_Message]) -> Prompt:
        """Template and content ids interleaved, the tip spans and the end of the task text."""
        template = self._template_pieces(tuple((role, len(pieces)) for role, pieces in msgs))
        ids = list(template[0])
        spans, prefix_len = [], 0
        for (kind, piece), tmpl in zip((p for _, pieces in msgs for p in pieces), template[1:]):
            if kind == "tip":
                spans.append((len(ids), len(ids) + len(piece)))
            ids += piece
            if kind == "task":
                prefix_len = len(ids)
            ids += tmpl
        return Prompt(ids, spans, prefix_len)

    # --------------------------------------------------------------------------------------- templates
    def _template_pieces(self, layout: tuple[tuple[str, int], ...]) -> list[list[int]]:
        """Token ids of the template text around the content slots of a message layout (cached).

        Returns n_slots + 1 id lists: before slot 0, between slots, after the last slot.
        """
        cached = self._template_cache.get(layout)
        if cached is not None:
            return cached
        messages, n = [], 0
        for role, count in layout:
            messages.append({"role": role, "content": "".join(_SLOT.format(n + j) for j in range(count))})
            n += count
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        parts = _SLOT_RE.split(text)  # [template, "0", template, "1", ..., template]
        if parts[1::2] != [str(i) for i in range(n)]:
            raise ChatTemplateError("the tokenizer's chat template drops, repeats or reorders message contents; "
                                    "PromptBuilder needs a template that renders each content once, in order")
        pieces = [self.tokenizer(p, add_special_tokens=False)["input_ids"] if p else [] for p in parts[0::2]]
        self._template_cache[layout] = pieces
        return pieces

    def _template_accepts_layout(self) -> bool:
        """Whether the template takes a system message and consecutive user messages (ChatML, Llama 3 do;
        some templates raise on either, and then neighbouring contents share one message)."""
        roles = (["system"] if self.system_prompt else []) + ["user", "user", "assistant", "user"]
        try:
            self._template_pieces(tuple((r, 1) for r in roles))
        except ChatTemplateError:
            raise
        except Exception:  # jinja's raise_exception surfaces as TemplateError; any failure means "no"
            return False
        return True

    def _encode_uncached(self, text: str, strip: bool = True) -> tuple[int, ...]:
        """Content ids (a tuple: cached values must not be mutated); special-token text stays plain text."""
        text = text.strip() if strip else text
        if not text:
            return ()
        # Lone surrogates (bytes decoded with errors="surrogateescape") are not valid text: Rust
        # tokenizers refuse them with a TypeError. They become U+FFFD, as undecodable bytes do elsewhere.
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        return tuple(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def _check_content_encoding(self) -> None:
        """Refuse a tokenizer on which split_special_tokens does not keep special tokens out of contents."""
        specials = [t for t in self.tokenizer.all_special_tokens if t]
        leaked = set(self._encode_uncached(" ".join(specials))) & set(self.tokenizer.all_special_ids)
        if leaked:
            raise ValueError(f"this tokenizer turns special-token text inside contents into special ids "
                             f"{sorted(leaked)}; PromptBuilder cannot keep untrusted text inert with it")
