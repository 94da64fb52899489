"""Every request option is defined once: the CLI, the Python API and the server reject the same bad
value with the same words (the option table's message)."""

import pytest
from click.testing import CliRunner

from helpers import Served, fake_engine
from mtad_edge.cli import cli
from mtad_edge.runtime.options import OPTIONS, check

# (option, value as the API and the server get it, the same value as typed on a command line)
BAD = [
    ("gamma", 0, "0"),
    ("gamma", 17, "17"),
    ("beam_width", 0, "0"),
    ("beam_width", 9, "9"),
    ("temperature", -1.0, "-1"),
    ("temperature", 3, "3"),
    ("temperature", float("nan"), "nan"),
    ("temperature", float("inf"), "inf"),
    ("top_p", 0, "0"),
    ("top_p", 1.5, "1.5"),
    ("top_p", float("nan"), "nan"),
    ("top_k", -2, "-2"),
    ("accept_threshold", 0, "0"),
    ("accept_threshold", 1.5, "1.5"),
    ("accept_threshold", float("nan"), "nan"),
    ("max_tokens", 0, "0"),
    ("seed", -1, "-1"),
    ("method", "nope", "nope"),
]


def expected(name, value) -> str:
    with pytest.raises(ValueError) as e:
        check(name, value)
    return str(e.value)


@pytest.fixture(scope="module")
def server():
    """The real app over fake backends, served on a free loopback port."""
    served = Served(fake_engine())
    yield served
    served.close()


@pytest.mark.parametrize("name,value,typed", BAD)
def test_cli_api_and_server_say_the_same_words(server, name, value, typed):
    msg = expected(name, value)
    assert name in msg and "must be" in msg
    with pytest.raises(ValueError) as api:  # the Python API
        fake_engine().generate("abc", **{name: value})
    assert str(api.value) == msg
    r = CliRunner().invoke(cli, ["generate", "hi", "--" + name.replace("_", "-"), typed])  # the CLI
    assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
    status, err = server.post({"prompt": "abc", name: value})  # the server
    assert status == 400 and err["error"]["message"] == msg and err["error"]["param"] == name


@pytest.mark.parametrize(
    "name,value",
    [
        ("temperature", "hot"),
        ("max_tokens", 2.5),
        ("seed", "x"),
        ("stop", 5),
        ("top_k", True),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", 0),  # falsy: the server read it as no stop strings (a 200)
        ("stop", False),
        # ints past float's range: an OverflowError (the server's 500) before
        pytest.param("temperature", 10**400, id="temperature-10**400"),
        pytest.param("top_p", -(10**400), id="top_p--10**400"),
        pytest.param("accept_threshold", 10**400, id="accept_threshold-10**400"),
        pytest.param("repeat_bar", 10**400, id="repeat_bar-10**400"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_parameter(server, name, value):
    msg = expected(name, value)
    with pytest.raises(ValueError) as api:
        fake_engine().generate("abc", **{name: value})
    assert str(api.value) == msg and msg.startswith(name)
    status, err = server.post({"prompt": "abc", name: value})
    assert status == 400 and err["error"]["message"] == msg and err["error"]["param"] == name


def test_every_option_has_a_default_that_passes_its_own_check():
    for opt in OPTIONS.values():
        assert check(opt.name, opt.default) == opt.default or opt.kind == "strings"


def test_method_help_lists_every_registered_method():
    from mtad_edge.runtime.methods import names

    r = CliRunner().invoke(cli, ["generate", "--help"])
    assert all(m in r.output for m in names())
