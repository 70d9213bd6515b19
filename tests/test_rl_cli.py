"""The command lines explain themselves: help and default of every option, --config files, refused idle flags."""
import dataclasses

import pytest

from rl.config import GROUPS, PRESETS, TrainConfig, flat_fields, save_config
from rl.train import _note_gpu_sized_defaults_on_cpu, build_parser, main, resolve_config

FIELDS = flat_fields()


def _help(capsys, entry, argv=("--help",)):
    with pytest.raises(SystemExit) as e:
        entry(list(argv))
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_field_has_a_group_and_a_line_of_help():
    for f in FIELDS:
        assert f.metadata.get("group") in GROUPS, f"{f.name}: add it to a group with rl.config._opt"
        assert len(f.metadata.get("help", "")) > 8, f"{f.name}: give it a line of help"


def test_train_help_shows_every_option_with_help_and_default(capsys):
    text = _help(capsys, main)
    blocks = {}  # option -> its help text (the lines up to the next option)
    for line in text.splitlines():
        if line.startswith("  --"):
            current = line.split()[0]
            blocks[current] = line
        elif line.startswith("    ") and blocks:
            blocks[current] += " " + line.strip()
    for f in FIELDS:
        flag = "--" + f.name.replace("_", "-")
        assert flag in blocks, flag
        assert "(default:" in blocks[flag] and f.metadata["help"][:20] in " ".join(blocks[flag].split()), flag
    assert blocks["--num-envs"].endswith("(default: 1024)")
    assert blocks["--total-timesteps"].endswith("(default: 10_000_000)")
    assert "--num_envs" not in text and "--skip_n" not in text  # underscore spellings are accepted, not listed
    for group in GROUPS:
        assert f"\n{group}:\n" in text


@pytest.mark.parametrize("module", ["rl.eval", "rl.label", "rl.plot", "jaxllm.http.server"])
def test_other_entry_points_show_defaults(module, capsys):
    import importlib

    mod = importlib.import_module(module)
    entry = getattr(mod, "main") if module != "jaxllm.http.server" else mod._parse_args
    text = _help(capsys, entry)
    options = [ln for ln in text.splitlines() if ln.startswith("  --")]
    assert options and "(default:" in text
    assert "_" not in " ".join(ln.split()[0] for ln in options)
    for ln in options:  # placeholders as rl.train writes them (N, X, TEXT, DIR, ...), not argparse's FLAG_NAME
        flag, *rest = ln.split()
        assert not rest or rest[0] != flag[2:].replace("-", "_").upper(), ln
    assert "(default: None)" not in text and max(len(ln) for ln in text.splitlines()) > 80  # wraps at 120 columns


def test_server_port_out_of_range_is_one_line(capsys):
    from jaxllm.http.server import _parse_args

    for port in ("70000", "-1"):
        with pytest.raises(SystemExit) as e:
            _parse_args(["--model", "tiny", "--port", port])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--port must be a TCP port number from 0 to 65535" in err and port in err
        assert len(err.strip().splitlines()) == 1
    assert _parse_args(["--model", "tiny", "--port", "0"]).port == 0


def test_required_server_model_shows_no_default(capsys):
    from jaxllm.http.server import _parse_args

    text = _help(capsys, _parse_args)
    model = next(ln for ln in text.splitlines() if ln.startswith("  --model"))
    assert "default" not in model


@pytest.mark.parametrize("argv,hint", [(["--num-evns", "4"], "did you mean --num-envs?"),
                                       (["--skipn", "4"], "did you mean --skip-n?")])
def test_mistyped_flag_names_the_nearest_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and hint in err and len(err.strip().splitlines()) == 1


def test_underscore_and_equals_spellings(tmp_path):
    args = build_parser().parse_args(["--num_envs=16", "--skip-n", "4", "--encoder=inscan", "--max_updates", "2"])
    cfg = resolve_config(args)
    assert (cfg.num_envs, cfg.skip_n, cfg.encoder, args.max_updates) == (16, 4, "inscan", 2)


def test_config_file_starts_a_new_run_and_flags_override(tmp_path):
    old = dataclasses.replace(TrainConfig(**PRESETS["test"]), encoder="inscan", seed=5, run_dir=str(tmp_path / "old"),
                              lr=1e-3)
    save_config(old, tmp_path / "config.json")
    cfg = resolve_config(build_parser().parse_args(["--config", str(tmp_path / "config.json"), "--seed", "6"]))
    assert cfg == dataclasses.replace(old, seed=6, run_dir=None)  # run_dir is not taken from the file
    (tmp_path / "c.yaml").write_text("num-envs: 16\nencoder: inscan\nlr: 0.003\n")
    cfg = resolve_config(build_parser().parse_args(["--config", str(tmp_path / "c.yaml"), "--preset", "test"]))
    assert (cfg.num_envs, cfg.encoder, cfg.lr) == (8, "inscan", 0.003)  # the preset overrides the file


@pytest.mark.parametrize("text,name,error", [('{"num_envs": 4, "colour": 1}', "c.json", "unknown setting 'colour'"),
                                             ('{"num_env": 4}', "c.json", "unknown setting 'num_env' (did you mean "
                                                                          "num_envs?)"),
                                             ("skip-N: 4\nlrate: 1\n", "c.yaml", "unknown settings 'lrate', 'skip_N' "
                                                                               "(did you mean skip_n for skip_N?)"),
                                             ("[1, 2]", "c.json", "expected a mapping"),
                                             ("a: [", "c.yaml", "not valid YAML"),
                                             (None, "missing.json", "cannot read it")])
def test_bad_config_file_is_one_line(tmp_path, capsys, text, name, error):
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and error in err and len(err.strip().splitlines()) == 1
    assert err.count("--help") == 1  # the hint once


@pytest.mark.parametrize("argv,named,fix", [
    (["--model", "Qwen/Qwen3-4B"], "--model", "--encoder inscan"),
    (["--skip-n", "7", "--llm-dtype", "fp8"], "--skip-n, --llm-dtype", "--encoder inscan"),
    (["--encoder", "inscan", "--vllm-url", "http://x:1"], "--vllm-url", "--encoder vllm"),
])
def test_flags_without_effect_are_refused(argv, named, fix, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--preset", "test", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and named in err and fix in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_preset_fields_without_effect_are_not_refused():
    """`--preset cpu` sets skip_n for LLM runs; with --encoder none that is not the user's doing."""
    from rl.config import inapplicable_flags

    assert inapplicable_flags([], "none") is None and inapplicable_flags(["skip_n"], "inscan") is None


def test_gpu_sized_defaults_on_cpu_say_so(capsys):
    _note_gpu_sized_defaults_on_cpu(build_parser().parse_args(["--encoder", "inscan"]))
    assert "--preset cpu" in capsys.readouterr().err
    for argv in (["--preset", "test"], ["--num-envs", "8"], ["--config", "x.json"]):
        _note_gpu_sized_defaults_on_cpu(build_parser().parse_args(argv))
        assert capsys.readouterr().err == ""
