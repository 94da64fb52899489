"""`mtad-edge chat`: piped stdin through CliRunner, the session logic, and a real tmux terminal."""

import os
import re
import shutil
import subprocess
import time

import pytest
from click.testing import CliRunner

from helpers import EXE
from mtad_edge.cli import cli
from mtad_edge.cli.chat import ChatSession

pytestmark = pytest.mark.slow


def test_piped_chat_runs_commands_and_answers(smol_files):
    stdin = "Hello! Who are you?\n/stats\n/method ar\nSay one word.\n/method nope\n/reset\n/bogus\n"
    r = CliRunner().invoke(cli, ["chat", "--max-tokens", "16", "--seed", "1", "--ctx-size", "512"], input=stdin)
    assert r.exit_code == 0, r.output
    answers = [line.removeprefix("> ").strip("> ") for line in r.stdout.splitlines() if line.strip("> ")]
    assert len(answers) == 2 and all(answers)
    err = r.stderr
    assert re.search(r"^(sd|mtad): .*block efficiency", err, re.M), err  # /stats: what auto chose
    assert (
        "(method: ar)" in err and "(no method 'nope'; still ar; choose from" in err and "(conversation cleared)" in err
    )
    assert "unknown command /bogus" in err


@pytest.mark.parametrize("stdin_errors", ["strict", "surrogateescape"])
def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(smol_files, stdin_errors):
    """A strict stdin (a UTF-8 locale's) raised UnicodeDecodeError out of input(), a traceback; a lenient
    one passed the bytes to the template's check, whose error ended the chat. Both lost the chat."""
    env = {**os.environ, "PYTHONIOENCODING": f"utf-8:{stdin_errors}"}
    cmd = [EXE, "chat", "--max-tokens", "8", "--seed", "1", "--ctx-size", "512"]
    r = subprocess.run(cmd, input=b"\xff\xfe hi\nSay ok.\n", capture_output=True, env=env, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "(not sent: " in err and "not valid UTF-8" in err
    answers = [line.strip("> ") for line in r.stdout.decode().splitlines() if line.strip("> ")]
    assert len(answers) == 1 and answers[0]  # the next line was answered


def test_a_system_message_that_is_not_utf8_is_refused_before_the_load(smol_files):
    """It was sent with every turn, so every line was refused and the chat could say nothing."""
    r = CliRunner().invoke(cli, ["chat", "--system", "be \udcff brief"], input="hi\n")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert (
        r.stderr.strip()
        == "Error: --system is not valid UTF-8 text: b'\\xff' at character 3 (undecodable bytes or lone surrogates)"
    )


@pytest.fixture
def engine(smol_files):
    from mtad_edge.engine import Engine

    with Engine.load(pair="smollm2-135m", n_ctx=512, threads=2, max_tokens=24) as eng:
        yield eng


class Sink(list):
    def write(self, s):
        self.append(s)

    def flush(self):
        pass


def test_stats_after_ctrl_c_name_the_stopped_answers_finish_reason(capsys):
    """/stats after Ctrl-C ended with an empty "finish": the answer stopped by the caller is
    "cancelled" in the stats too, as the API and the server say."""
    from helpers import fake_engine

    class CtrlC:
        def __init__(self):
            self.said = []

        def write(self, s):  # Ctrl-C lands while the first piece is written
            self.said.append(s)
            if len(self.said) == 1:
                raise KeyboardInterrupt

        def flush(self):
            pass

    s = ChatSession(fake_engine(max_tokens=50), "mtad", None, drop_oldest=False, out=CtrlC())
    s.turn("hi")
    assert s.out.said[-1] == " [stopped]\n" and s.last_stats.finish_reason == "cancelled"
    assert s.last_stats.generated < 50
    s.command("/stats")
    assert capsys.readouterr().err.rstrip().endswith("finish cancelled")


def test_each_turn_prefills_only_what_is_new(engine):
    s = ChatSession(engine, "mtad", "You are terse.", drop_oldest=False, out=Sink())
    s.turn("Name a fruit.")
    first = s.last_stats
    s.turn("Name another one.")
    second = s.last_stats
    assert first.cached_tokens == 0 < second.cached_tokens
    # everything up to the first answer was cached; only the new turn's template and text are new
    assert second.prompt_tokens - second.cached_tokens < 20 < second.cached_tokens
    assert [t["role"] for t in s.turns] == ["user", "assistant", "user", "assistant"]


def test_json_mode_makes_each_answer_a_json_object(engine, capsys):
    import json

    s = ChatSession(engine, "mtad", None, drop_oldest=False, out=Sink())
    s.command("/json")
    s.turn("Describe a cat.")
    assert "(JSON mode: each answer is a JSON object)" in capsys.readouterr().err
    answer = s.turns[-1]["content"]
    if s.last_stats.finish_reason == "stop":  # else max_tokens cut it (24 here)
        assert isinstance(json.loads(answer), dict)
    else:
        assert answer.startswith("{") and s.last_stats.finish_reason == "length"
    s.command("/json")
    assert "(JSON mode off)" in capsys.readouterr().err and not s.json_mode


def test_context_full_refuses_or_drops_oldest_turns(engine, capsys):
    long = "Tell me about rivers. " * 40  # ~200 tokens a turn in a 512-token context
    s = ChatSession(engine, "ar", None, drop_oldest=False, out=Sink())
    for _ in range(4):
        s.turn(long)
    assert "context full" in capsys.readouterr().err
    assert len(s.turns) < 8  # the refused turns were not kept
    d = ChatSession(engine, "ar", None, drop_oldest=True, out=Sink())
    for _ in range(4):
        d.turn(long)
    assert "dropped the oldest turn" in capsys.readouterr().err
    assert d.turns[-1]["role"] == "assistant" and len(d.turns) < 8


def test_a_line_too_long_alone_is_not_told_to_reset(engine, capsys):
    """/reset and --drop-oldest drop earlier turns; with none, that advice could not help."""
    s = ChatSession(engine, "ar", "You are terse.", drop_oldest=True, out=Sink())
    s.turn("Tell me about rivers. " * 200)
    err = capsys.readouterr().err
    assert "context full" in err and "raise --ctx-size" in err and "/reset" not in err and "--drop-oldest" not in err
    assert s.turns == []


@pytest.mark.parametrize("words", [1200, 712])  # longer than the context's 768 cells; inside them, past mtad's 710
def test_a_system_message_longer_than_the_context_is_refused_at_the_start(smol_files, words):
    """It is part of every turn, so no turn could be answered: each was refused as 'context full'."""
    r = CliRunner().invoke(cli, ["chat", "--ctx-size", "512", "--system", "word " * words], input="hi\n")
    assert r.exit_code == 1 and "Traceback" not in r.output
    err = r.stderr.strip()
    assert err.startswith("Error: --system takes ") and err.endswith("shorten it or raise --ctx-size"), err
    assert "\n" not in err and r.stdout == ""  # refused before the prompt


def test_a_turn_refused_for_the_system_message_names_it(engine, capsys):
    per = len(engine.tokenize("Be brief. " * 10)) / 10
    s = ChatSession(engine, "ar", "Be brief. " * int((engine.n_ctx - 40) / per), drop_oldest=True, out=Sink())
    assert engine.n_ctx - 80 < s.system_tokens < engine.n_ctx  # it fits alone; with the line, it does not
    s.turn("Tell me about rivers. " * 20)
    err = capsys.readouterr().err
    assert "context full" in err and f"The --system message takes {s.system_tokens} of those tokens." in err
    assert s.turns == []


def _tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def _wait_for(session, predicate, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        screen = _tmux("capture-pane", "-p", "-t", session)
        if predicate(screen):
            return screen
        time.sleep(0.3)
    raise AssertionError(f"timed out; screen:\n{screen}")


def _type_line(session, text, tries=3):
    """Type `text`, see it echoed, then press Enter. A loaded CI machine once lost keys sent the
    moment the prompt appeared, so unechoed keys are typed again (the line is still empty then)."""
    for _ in range(tries):
        _tmux("send-keys", "-t", session, "-l", text)
        try:
            _wait_for(session, lambda s: s.rstrip().endswith(text), timeout=10)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError(f"the terminal never echoed {text!r}")
    _tmux("send-keys", "-t", session, "Enter")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_chat_in_a_real_terminal_ctrl_c_and_ctrl_d(smol_files, tmp_path):
    session = f"mtadchat{os.getpid()}"
    done = tmp_path / "exit-code"
    cmd = f"{EXE} chat --ctx-size 1024 --max-tokens 900 --seed 3 --method ar; echo $? > {done}"
    _tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd)
    try:
        _wait_for(session, lambda s: s.rstrip().endswith(">"))
        _type_line(session, "Write a very long story about a dragon.")
        _wait_for(session, lambda s: "dragon." in s and len(s.rsplit("dragon.", 1)[1].strip()) > 40)  # streaming
        _tmux("send-keys", "-t", session, "C-c")
        screen = _wait_for(session, lambda s: "[stopped]" in s and s.rstrip().endswith(">"))
        _type_line(session, "/stats")
        _wait_for(session, lambda s: "block efficiency" in s and "finish cancelled" in s)
        _tmux("send-keys", "-t", session, "C-d")
        deadline = time.time() + 60
        while not done.exists() and time.time() < deadline:
            time.sleep(0.2)
        assert done.read_text().strip() == "0"
        assert "Traceback" not in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
