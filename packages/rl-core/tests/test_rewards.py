"""The reward library: every reward on positive and negative cases, numbers written out."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError, RewardError
from rl_core.interfaces import GroupRewardFn, RewardFn
from rl_core.rewards import (
    F1,
    Combine,
    ExactMatch,
    FormatMatch,
    MajorityVote,
    MathEquiv,
    RemoteReward,
    f1_score,
)
from rl_core.types import Prompt, Rollout


def _prompt(label=None, uid="p0") -> Prompt:
    return Prompt(uid=uid, input="What is 12+7?", token_ids=(1, 2), label=label, metadata={"k": 1})


def _rollout(sid="p0/0") -> Rollout:
    return Rollout(
        prompt_uid="p0",
        rollout_id=sid,
        sample_id=sid,
        tokens=(1, 2, 3),
        response_start=2,
        loss_mask=(1,),
        rollout_logprobs=(-0.5,),
        versions=(0,),
    )


def _run(value):
    return asyncio.run(value) if asyncio.iscoroutine(value) else value


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------


def test_entry_points_registered_and_built_from_config():
    assert {"exact_match", "math_equiv", "f1", "format_match", "remote", "combine"} <= set(
        registry.available("rl.rewards")
    )
    fn = registry.build(
        "reward", ComponentSpec(type="exact_match", options={"case_sensitive": True})
    )
    assert isinstance(fn, ExactMatch) and fn.config.case_sensitive is True
    assert isinstance(fn, RewardFn)
    with pytest.raises(ConfigError, match=r"reward\.nope: unknown field"):
        registry.build(
            "reward", ComponentSpec(type="exact_match", options={"nope": 1}), field="reward"
        )
    with pytest.raises(ConfigError, match=r"reward\.pattern: missing required field"):
        registry.build("reward", ComponentSpec(type="format_match"), field="reward")


# ------------------------------------------------------------------------------------------
# exact_match
# ------------------------------------------------------------------------------------------


def test_exact_match_positive_and_negative():
    em = ExactMatch()
    assert em(_prompt("Paris"), "  paris\n", _rollout()) == 1.0
    assert em(_prompt(["Lyon", "Paris  France"]), "paris \t france", _rollout()) == 1.0
    assert em(_prompt(19), "19", _rollout()) == 1.0  # numeric label compared as text
    assert em(_prompt("Paris"), "Lyon", _rollout()) == 0.0
    assert em(_prompt("Paris"), "Paris.", _rollout()) == 0.0  # no punctuation stripping
    assert em(_prompt("Paris"), None, _rollout()) == 0.0  # type: ignore[arg-type]


def test_exact_match_options():
    strict = ExactMatch(
        ExactMatch.Config(strip=False, case_sensitive=True, collapse_whitespace=False)
    )
    assert strict(_prompt("Paris"), "Paris", None) == 1.0
    assert strict(_prompt("Paris"), "paris", None) == 0.0
    assert strict(_prompt("Paris"), " Paris", None) == 0.0
    assert strict(_prompt("a b"), "a  b", None) == 0.0
    extracting = ExactMatch(ExactMatch.Config(answer_pattern=r"Answer:\s*(.+)"))
    assert extracting(_prompt("19"), "Answer: 18\nwait... Answer: 19", None) == 1.0  # last match
    assert extracting(_prompt("19"), "19", None) == 0.0  # no "Answer:" -> wrong
    with pytest.raises(ConfigError, match="reward.answer_pattern: invalid regular expression"):
        ExactMatch.Config(answer_pattern="(")


def test_label_missing_is_a_reward_error():
    with pytest.raises(RewardError, match=r"prompt 'p0' has label None.*Prompt.label"):
        ExactMatch()(_prompt(None), "x", None)
    with pytest.raises(RewardError, match="f1"):
        F1()(_prompt({"a": 1}), "x", None)


# ------------------------------------------------------------------------------------------
# f1
# ------------------------------------------------------------------------------------------


def test_f1_score_numbers():
    # overlap 2 ("cat", "sat"): precision 2/3, recall 2/4 -> F1 = 4/7
    assert f1_score("the cat sat", "a cat sat down") == pytest.approx(4 / 7)
    assert f1_score("a a b", "a b b") == pytest.approx(2 / 3)  # multiset overlap 2 of 3 and 3
    assert f1_score("", "") == 1.0
    assert f1_score("x", "") == 0.0
    assert f1_score("x y", "z") == 0.0


def test_f1_reward_positive_and_negative():
    f1 = F1()
    assert f1(_prompt("The Eiffel Tower"), "the eiffel tower.", None) == 1.0
    # best of two labels: "paris" vs "paris france" -> P=1, R=1/2 -> 2/3; vs "paris" -> 1
    assert f1(_prompt(["Paris, France", "Paris"]), "Paris!", None) == 1.0
    assert f1(_prompt("Paris, France"), "Paris!", None) == pytest.approx(2 / 3)
    assert f1(_prompt("Paris"), "Lyon", None) == 0.0
    assert f1(_prompt("Paris"), 42, None) == 0.0  # type: ignore[arg-type]
    cased = F1(F1.Config(case_sensitive=True, strip_punctuation=False))
    assert cased(_prompt("Paris France"), "paris France.", None) == 0.0
    assert cased(_prompt("Paris France"), "Paris France", None) == 1.0


# ------------------------------------------------------------------------------------------
# format_match
# ------------------------------------------------------------------------------------------


def test_format_match_search_and_fullmatch():
    think = FormatMatch(
        FormatMatch.Config(
            pattern=r"<think>.*</think>\s*<answer>.*</answer>", mode="fullmatch", dotall=True
        )
    )
    assert think(None, "<think>a\nb</think>\n<answer>19</answer>", None) == 1.0
    assert think(None, "<think>a</think><answer>19</answer> trailing", None) == 0.0
    assert think(None, "no tags", None) == 0.0
    boxed = FormatMatch(FormatMatch.Config(pattern=r"\\boxed\{.+\}"))
    assert boxed(None, r"so the answer is \boxed{19}.", None) == 1.0
    assert boxed(None, "so the answer is 19", None) == 0.0
    assert boxed(None, b"\\boxed{1}", None) == 0.0  # type: ignore[arg-type]
    loud = FormatMatch(FormatMatch.Config(pattern="^answer:", ignore_case=True, multiline=True))
    assert loud(None, "thinking\nANSWER: 3", None) == 1.0
    assert FormatMatch(FormatMatch.Config(pattern="^answer:"))(None, "x\nanswer:", None) == 0.0
    with pytest.raises(ConfigError, match="reward.pattern"):
        FormatMatch.Config(pattern="[")
    with pytest.raises(ConfigError, match="reward.mode"):
        FormatMatch.Config(pattern="x", mode="match")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# math_equiv
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def math_equiv():
    pytest.importorskip("math_verify")
    return MathEquiv()


@pytest.mark.parametrize(
    ("label", "response"),
    [
        ("19", r"12 + 7 gives $\boxed{19}$."),
        ("0.5", r"$\frac{1}{2}$"),
        (r"\frac{1}{2}", "0.5"),
        (19, "x = 19"),
        ("2", r"$\sqrt{4}$"),
        (["7", "19"], "The answer is 19"),
    ],
)
def test_math_equiv_positive(math_equiv, label, response):
    assert math_equiv(_prompt(label), response, _rollout()) == 1.0


@pytest.mark.parametrize(
    "response",
    ["The answer is 18", r"$\boxed{20}$", "", "garbage ### \\frac{", "no number here", None],
)
def test_math_equiv_negative(math_equiv, response):
    assert math_equiv(_prompt("19"), response, _rollout()) == 0.0


def test_math_equiv_errors(math_equiv, monkeypatch):
    with pytest.raises(RewardError, match="has label None"):
        math_equiv(_prompt(None), "19", None)
    with pytest.raises(ConfigError, match="reward.timeout_seconds"):
        MathEquiv.Config(timeout_seconds=0)
    # Without the optional dependency the reward cannot be built, and says how to fix it.
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(RewardError, match=r"rlpost-core\[math\]"):
        MathEquiv()


def test_math_equiv_records_math_verify_errors(monkeypatch, caplog):
    """An exception inside math_verify scores 0 as before, but is counted and logged."""
    pytest.importorskip("math_verify")
    reward = MathEquiv()
    real = reward._mv

    class Failing:  # math_verify whose comparison raises (e.g. on an odd sympy object)
        parse = staticmethod(real.parse)

        @staticmethod
        def verify(*args, **kwargs):
            raise RuntimeError("cannot compare these")

    monkeypatch.setattr(reward, "_mv", Failing)
    with caplog.at_level(logging.DEBUG, logger="rl_core.rewards.math_answer"):
        assert reward(_prompt("19"), "$19$", None) == 0.0
        assert reward(_prompt("19"), "$19$", None) == 0.0
    assert reward.errors == {"parse": 0, "verify": 2}
    levels = [r.levelno for r in caplog.records if "cannot compare these" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG]


def test_math_equiv_works_off_the_main_thread(math_equiv):
    out = []
    t = threading.Thread(target=lambda: out.append(math_equiv(_prompt("19"), "$19$", None)))
    t.start()
    t.join()
    assert out == [1.0]


def test_rewards_package_does_not_import_optional_deps():
    """``math_verify`` (and what it pulls in) is imported only when ``math_equiv`` is built."""
    code = (
        "import sys, rl_core, rl_core.rewards\n"
        "from rl_core import registry\n"
        "from rl_core.config import ComponentSpec\n"
        "registry.build('reward', ComponentSpec(type='exact_match'))\n"
        "heavy = ('math_verify', 'latex2sympy2_extended', 'sympy', 'httpx', 'transformers',\n"
        "         'tokenizers', 'safetensors')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
        "registry.build('reward', ComponentSpec(type='math_equiv'))\n"
        "print('math_verify' in sys.modules)\n"
    )
    has_math = importlib.util.find_spec("math_verify") is not None
    if not has_math:  # without the extra, only the first half applies
        code = code.split("registry.build('reward', ComponentSpec(type='math_equiv'))")[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == (["[]", "True"] if has_math else ["[]"])


# ------------------------------------------------------------------------------------------
# remote
# ------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    calls: dict[str, int] = {}
    bodies: list[dict] = []

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.bodies.append(body)
        n = _Handler.calls[self.path] = _Handler.calls.get(self.path, 0) + 1
        if self.path == "/ok":
            self._send(200, json.dumps({"reward": 0.75, "length_penalty": -0.25, "note": "x"}))
        elif self.path == "/number":
            self._send(200, "0.5")
        elif self.path == "/score-key":
            self._send(200, json.dumps({"score": 2.0}))
        elif self.path == "/flaky":  # two 503s, then a good answer
            self._send(503, "busy") if n <= 2 else self._send(200, '{"reward": 1.0}')
        elif self.path == "/down":
            self._send(503, "busy")
        elif self.path == "/bad-json":
            self._send(200, "<html>oops</html>")
        elif self.path == "/missing-key":
            self._send(200, json.dumps({"score": 1.0}))
        elif self.path == "/nan":
            self._send(200, '{"reward": NaN}')
        elif self.path == "/slow":
            time.sleep(0.5)
            self._send(200, '{"reward": 1.0}')
        else:
            self._send(404, "no such route")

    def _send(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        # The client may have timed out first (/slow).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _remote(url: str, **kw) -> RemoteReward:
    kw.setdefault("backoff_seconds", 0.01)
    kw.setdefault("timeout_seconds", 2.0)
    return RemoteReward(RemoteReward.Config(url=url, **kw))


def test_remote_success_and_payload(server):
    _Handler.bodies.clear()
    out = asyncio.run(_remote(f"{server}/ok")(_prompt("19"), "it is 19", _rollout("p0/3")))
    assert out == {"reward": 0.75, "length_penalty": -0.25}  # non-numeric "note" dropped
    assert _Handler.bodies[-1] == {
        "prompt": "What is 12+7?",
        "response": "it is 19",
        "label": "19",
        "prompt_uid": "p0",
        "sample_id": "p0/3",
        "metadata": {"k": 1},
    }
    assert asyncio.run(_remote(f"{server}/number")(_prompt(), "x", None)) == {"reward": 0.5}
    keyed = _remote(f"{server}/score-key", reward_key="score")
    assert asyncio.run(keyed(_prompt(), "x", None)) == {"reward": 2.0}


def test_remote_retries_with_backoff(server):
    _Handler.calls.pop("/flaky", None)
    out = asyncio.run(_remote(f"{server}/flaky", max_retries=2)(_prompt(), "x", None))
    assert out == {"reward": 1.0}
    assert _Handler.calls["/flaky"] == 3
    _Handler.calls.pop("/down", None)
    with pytest.raises(RewardError, match=r"failed after 3 attempts; last error: HTTP 503"):
        asyncio.run(_remote(f"{server}/down", max_retries=2)(_prompt(), "x", None))
    assert _Handler.calls["/down"] == 3


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("/bad-json", "not JSON"),
        ("/missing-key", r"no 'reward' key \(keys: \['score'\]\).*reward_key"),
        ("/nan", "finite"),
        ("/unknown", "HTTP 404"),
    ],
)
def test_remote_clear_errors_without_retry(server, path, match):
    _Handler.calls.pop(path, None)
    with pytest.raises(RewardError, match=match):
        asyncio.run(_remote(f"{server}{path}", max_retries=3)(_prompt(), "x", None))
    assert _Handler.calls[path] == 1  # permanent errors are not retried


def test_remote_timeout_and_connection_refused(server):
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"failed after 2 attempts.*(?i:timed out|timeout)"):
        asyncio.run(
            _remote(f"{server}/slow", timeout_seconds=0.1, max_retries=1)(_prompt(), "x", None)
        )
    assert time.monotonic() - t0 < 1.5
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(RewardError, match="failed after 1 attempts"):
        asyncio.run(_remote(f"http://127.0.0.1:{port}/x", max_retries=0)(_prompt(), "x", None))


def test_remote_config_errors():
    with pytest.raises(ConfigError, match="reward.url"):
        RemoteReward.Config(url="file:///etc/passwd")
    with pytest.raises(ConfigError, match="reward.max_retries"):
        RemoteReward.Config(url="http://127.0.0.1:1/", max_retries=-1)
    with pytest.raises(ConfigError, match="reward.timeout_seconds"):
        RemoteReward.Config(url="http://127.0.0.1:1/", timeout_seconds=0)


# ------------------------------------------------------------------------------------------
# combine
# ------------------------------------------------------------------------------------------


def test_combine_weighted_sum_from_config():
    fn = registry.build(
        "reward",
        ComponentSpec(
            type="combine",
            options={
                "components": {
                    "correct": {"reward": {"type": "exact_match"}, "weight": 1.0},
                    "format": {
                        "reward": {"type": "format_match", "pattern": r"^Answer: "},
                        "weight": 0.5,
                    },
                }
            },
        ),
        field="reward",
    )
    assert isinstance(fn, Combine)
    assert asyncio.run(fn(_prompt("19"), "Answer: 19", None)) == {
        "correct": 0.0,  # "answer: 19" != "19" (no extraction configured)
        "format": 1.0,
        "reward": 0.5,
    }
    assert asyncio.run(fn(_prompt("19"), "19", None)) == {
        "correct": 1.0,
        "format": 0.0,
        "reward": 1.0,
    }
    assert asyncio.run(fn(_prompt("19"), "18", None))["reward"] == 0.0


def test_combine_of_mixes_sync_async_and_mappings():
    async def length_penalty(prompt, response, rollout):
        await asyncio.sleep(0)
        return {"reward": -0.1 * len(response), "chars": float(len(response))}

    fn = Combine.of(correct=(ExactMatch(), 2.0), length=(length_penalty, 1.0))
    out = asyncio.run(fn(_prompt("19"), "19", None))
    assert out == pytest.approx(
        {"correct": 1.0, "length": -0.2, "length/chars": 2.0, "reward": 1.8}
    )
    assert asyncio.run(fn(_prompt("19"), "20", None))["reward"] == pytest.approx(-0.2)


def test_combine_errors(monkeypatch):
    def nan(prompt, response, rollout):
        return float("nan")

    def no_key(prompt, response, rollout):
        return {"score": 1.0}

    with pytest.raises(RewardError, match="component 'bad' returned nan"):
        asyncio.run(Combine.of(ok=(ExactMatch(), 1.0), bad=(nan, 1.0))(_prompt("1"), "1", None))
    with pytest.raises(RewardError, match="without a 'reward' key"):
        asyncio.run(Combine.of(x=(no_key, 1.0))(_prompt("1"), "1", None))
    with pytest.raises(ConfigError, match="not 'reward'"):
        Combine.of(reward=(ExactMatch(), 1.0))
    with pytest.raises(ConfigError, match="at least one"):
        Combine.Config(components={})
    with pytest.raises(ConfigError, match=r"components\.x\.reward.*does not match RewardFn"):
        monkeypatch.setitem(registry._LOCAL, "rl.rewards", {"_test_two_args": lambda a, b: 0.0})
        registry.build(
            "reward",
            ComponentSpec(
                type="combine", options={"components": {"x": {"reward": "_test_two_args"}}}
            ),
        )


# ------------------------------------------------------------------------------------------
# group reward
# ------------------------------------------------------------------------------------------


def test_majority_vote_positive_and_negative():
    mv = MajorityVote(MajorityVote.Config(answer_pattern=r"Answer:\s*(\S+)"))
    assert isinstance(mv, GroupRewardFn)
    rs = [_rollout(f"p0/{i}") for i in range(5)]
    responses = ["Answer: 19", "answer: x Answer: 19", "Answer: 18", "Answer: 19 ", "no idea"]
    out = mv(_prompt(), responses, rs)
    assert [o["reward"] for o in out] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert [o["agreement"] for o in out] == [0.6, 0.6, 0.2, 0.6, 0.0]
    # A tie at the top is no consensus.
    tie = mv(_prompt(), ["Answer: 1", "Answer: 2", "Answer: 1", "Answer: 2"], rs[:4])
    assert [o["reward"] for o in tie] == [0.0, 0.0, 0.0, 0.0]
    # min_share: 2 of 5 agree (0.4) -> below 0.5 -> nobody scores.
    strict = MajorityVote(MajorityVote.Config(min_share=0.5))
    weak = strict(_prompt(), ["a", "a", "b", "c", "d"], rs)
    assert [o["reward"] for o in weak] == [0.0] * 5
    assert [o["reward"] for o in strict(_prompt(), ["a", "a", "a", "b", None], rs)] == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    with pytest.raises(RewardError, match="group reward"):
        mv(_prompt(), "Answer: 19", rs[0])  # misused as a per-rollout reward
    with pytest.raises(ConfigError, match="min_share"):
        MajorityVote.Config(min_share=1.5)
