"""Hostile config files: nested aliases ("billion laughs"), recursion, deep nesting and huge values are refused
or echoed shortly, with bounded memory (nbaccel.utils.safe_yaml)."""

from __future__ import annotations

import tracemalloc
import warnings

import pytest
import yaml

from nbaccel.utils.config_file import ConfigError, load_config
from nbaccel.utils.safe_yaml import DocumentTooLargeError, load_yaml, short_repr

pytestmark = pytest.mark.timeout(120)

# The classic document: 9 levels of 9 aliases each, 9**9 (387 million) strings once expanded; a known key
# (mixed_precision) holds the whole value, so an error message that echoes it would print all of them.
BILLION_LAUGHS = """\
lol1: &lol1 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
lol2: &lol2 [*lol1,*lol1,*lol1,*lol1,*lol1,*lol1,*lol1,*lol1,*lol1]
lol3: &lol3 [*lol2,*lol2,*lol2,*lol2,*lol2,*lol2,*lol2,*lol2,*lol2]
lol4: &lol4 [*lol3,*lol3,*lol3,*lol3,*lol3,*lol3,*lol3,*lol3,*lol3]
lol5: &lol5 [*lol4,*lol4,*lol4,*lol4,*lol4,*lol4,*lol4,*lol4,*lol4]
lol6: &lol6 [*lol5,*lol5,*lol5,*lol5,*lol5,*lol5,*lol5,*lol5,*lol5]
lol7: &lol7 [*lol6,*lol6,*lol6,*lol6,*lol6,*lol6,*lol6,*lol6,*lol6]
lol8: &lol8 [*lol7,*lol7,*lol7,*lol7,*lol7,*lol7,*lol7,*lol7,*lol7]
lol9: &lol9 [*lol8,*lol8,*lol8,*lol8,*lol8,*lol8,*lol8,*lol8,*lol8]
mixed_precision: *lol9
"""


def test_billion_laughs_is_refused_with_a_short_message_and_little_memory(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 700
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as info:
            load_config(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert len(message) < 400, message
    assert message.startswith(f"{path}: refused: ") and "billion laughs" in message and "100000" in message
    assert peak < 20 * len(BILLION_LAUGHS) * 1024  # the expanded value alone would take gigabytes
    assert isinstance(info.value.__cause__, DocumentTooLargeError)


def test_billion_laughs_under_nbaccel_launch_and_to_fsdp2_is_a_short_usage_error(tmp_path, capsys):
    from nbaccel.commands.main import main

    path = tmp_path / "laughs.yaml"
    path.write_text(BILLION_LAUGHS)
    for args in (["launch", "--config_file", str(path), "examples/hello_ranks.py"],
                 ["to-fsdp2", "--config_file", str(path), "--output_file", str(tmp_path / "out.yaml")]):
        try:
            code = main(args)
        except SystemExit as exc:
            code = exc.code
        except (yaml.YAMLError, ValueError) as exc:  # to-fsdp2 raises as Accelerate's command does
            code, _ = 1, print(exc, file=__import__("sys").stderr)
        err = capsys.readouterr().err
        assert code not in (0, None) and "billion laughs" in err and len(err) < 2000, (args, err[:2000])
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("document, reason", [
    ("a: &a [1, *a]\n", "recursive alias"),
    ("num_processes: " + "[" * 200 + "]" * 200 + "\n", "levels deep"),
    ("x: [" + ", ".join(["1"] * 100_001) + "]\n", "more than 100000 values"),
])
def test_recursive_deep_and_huge_documents_are_refused(document, reason):
    with pytest.raises(DocumentTooLargeError, match=reason):
        load_yaml(document)


def test_ordinary_documents_and_small_aliases_load_as_with_safe_load():
    document = ("base: &base {fsdp_version: 2, fsdp_offload_params: false}\nfsdp_config: *base\n"
                "num_processes: 2\nlist: [1, 2.5, null, yes, '3']\nempty:\n")
    assert load_yaml(document) == yaml.safe_load(document)
    assert load_yaml("") is None and load_yaml("# only a comment\n") is None
    with pytest.raises(yaml.constructor.ConstructorError):
        load_yaml("!!python/object/apply:os.system ['true']\n")  # still a safe loader


def test_values_echoed_in_errors_and_warnings_are_shortened(tmp_path):
    path = tmp_path / "long.yaml"
    unknown_keys = "".join(f"{index:03}{'k' * 900}: 1\n" for index in range(500))  # YAML's limit: 1024
    path.write_text(f"mixed_precision: [{', '.join(['fp16'] * 5000)}]\ngpu_ids: '{'9' * 5000},x'\n"
                    f"num_processes: -{'7' * 4000}\n{unknown_keys}")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ConfigError) as info:
        warnings.simplefilter("always")
        load_config(path)
    message = str(info.value)
    assert len(message) < 1000, message
    for key in ("mixed_precision", "gpu_ids", "num_processes"):
        assert f"long.yaml: {key}: " in message
    assert "['fp16', 'fp16', 'fp16', 'fp16', 'fp16', 'fp16', ...]" in message
    (warning,) = [w for w in caught if "unknown key" in str(w.message)]
    assert len(str(warning.message)) < 400


def test_a_value_python_cannot_build_is_a_yaml_error():
    with pytest.raises(yaml.YAMLError, match="a value cannot be read: .*Exceeds the limit"):
        load_yaml("num_processes: " + "7" * 5000)


def test_short_repr_is_bounded_for_any_value():
    nested = [[[[[list(range(10**5))]]]]]
    assert len(short_repr(nested)) <= 120 and len(short_repr("x" * 10**6)) <= 120
    assert short_repr("fp13") == "'fp13'" and short_repr(3) == "3"
