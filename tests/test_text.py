"""Detokenizer, stop strings, chat templates and the native token helpers (with their twins)."""
from __future__ import annotations

import numpy as np
import pytest

from edgespec.decode import tokens
from edgespec.decode.chat_template import ChatTemplate
from edgespec.decode.detok import Detokenizer, StopMatcher
from edgespec.errors import InvalidRequest


def test_detokenizer_holds_split_characters():
    data = "é世🎉".encode()
    d = Detokenizer()
    out = [d.feed(data[i:i + 1]) for i in range(len(data))]
    assert "".join(out) + d.flush() == "é世🎉"
    assert all("\ufffd" not in o for o in out)
    assert out[0] == "" and out[1] == "é"


def test_detokenizer_flushes_an_incomplete_tail_as_replacement():
    d = Detokenizer()
    assert d.feed(b"ok\xe4\xb8") == "ok"
    assert d.flush() == "\ufffd"


@pytest.mark.parametrize("chunks, stops, streamed, hit, final", [
    (["Hello", " wor", "ld"], ["world"], "Hello ", True, "Hello "),
    (["abc", "STO", "P", "x"], ["STOP"], "abc", True, "abc"),
    (["ab", "c"], ["cd"], "ab", False, "abc"),  # "c" is held back: it may start "cd"
    (["no stop here"], [], "no stop here", False, "no stop here"),
    (["x</s", "tyle>"], ["</s>"], "x</style>", False, "x</style>"),
])
def test_stop_matcher(chunks, stops, streamed, hit, final):
    m = StopMatcher(stops)
    out, was_hit = "", False
    for c in chunks:
        text, was_hit = m.feed(c)
        out += text
        if was_hit:
            break
    assert (out, was_hit) == (streamed, hit)
    # At the end of generation, held-back text is released unless a stop string was hit.
    assert out + ("" if was_hit else m.flush()) == final


class _Pieces:
    """A vocabulary of byte pieces (some split a character), token 1 the end of generation."""

    PIECES = [b"", b"", b"a", b" b", b"\xe2", b"\x82\xac", b"STO", b"P", b"\xff", "世".encode(), b"\n"]

    def is_eog(self, token: int) -> bool:
        return token == 1

    def token_piece(self, token: int) -> bytes:
        return self.PIECES[token]


@pytest.mark.parametrize("stops", [(), ("STOP",), ("\n",)])
def test_a_steps_tokens_pushed_at_once_end_as_token_by_token(stops):
    """push_step gives the answer push gives token by token: its tokens, text, end and reason,
    the drafted tokens marked, whatever the steps' sizes."""
    from edgespec.decode.output import OutputStream

    rng = np.random.default_rng(5)
    for _ in range(500):
        max_tokens, ignore_eos = int(rng.integers(1, 30)), bool(rng.random() < 0.3)
        stream = rng.integers(0, len(_Pieces.PIECES), 40).tolist()
        one, many = (OutputStream(_Pieces(), max_tokens, stops, ignore_eos) for _ in range(2))
        singles, grouped, k = [], [], 0
        while not many.done and k < len(stream):
            n, drafts = int(rng.integers(1, 8)), int(rng.integers(0, 8))
            step, k = stream[k:k + n], k + n
            grouped += many.push_step(step, min(drafts, len(step) - 1))
            for j, token in enumerate(step):
                if not one.done:
                    event = one.push(token, from_draft=j < min(drafts, len(step) - 1))
                    singles += [event] if event is not None else []
        tails = [one.end(), many.end()]
        assert (one.tokens, one.finish_reason) == (many.tokens, many.finish_reason)
        assert one.text == many.text == "".join(e.text for e in grouped) + (tails[1].text if tails[1] else "")
        assert [t for e in singles for t in e.token_ids] == [t for e in grouped for t in e.token_ids]
        assert [e.from_draft for e in singles for _ in e.token_ids] == \
            [e.from_draft for e in grouped for _ in e.token_ids]


QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_template_renders_conversation():
    t = ChatTemplate(QWEN_LIKE)
    text = t.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_sandbox_blocks_python_internals():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequest, match="template"):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def test_template_raise_exception_becomes_invalid_request():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}]])
def test_bad_messages(messages):
    with pytest.raises(InvalidRequest):
        ChatTemplate(QWEN_LIKE).render(messages)


def test_missing_template_falls_back_to_plain_text():
    t = ChatTemplate(None)
    assert not t.available
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\n\nb"


IMPLS = [pytest.param(tokens.common_prefix, id="python")]
if tokens.HAVE_NATIVE:
    IMPLS.append(pytest.param(tokens.fast_common_prefix, id="native"))


def test_native_extension_was_built():
    # `make` installs with a compiler present; the twin is only for machines without one.
    assert tokens.HAVE_NATIVE


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("a, b, n", [([], [], 0), ([1], [], 0), ([1, 2, 3], [1, 2, 3], 3),
                                     ([1, 2, 3], [1, 2, 4], 2), ([5], [6], 0), ([1, 2], [1, 2, 3], 2)])
def test_common_prefix(impl, a, b, n):
    assert impl(a, b) == n


@pytest.mark.parametrize("impl", IMPLS)
def test_common_prefix_random_against_twin(impl):
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.integers(0, 3, rng.integers(0, 50)).tolist()
        b = a[: rng.integers(0, len(a) + 1)] + rng.integers(0, 3, rng.integers(0, 5)).tolist()
        assert impl(a, b) == tokens.common_prefix(a, b)
