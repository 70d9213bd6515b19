"""End-to-end `python -m rl.train` (in process): run dir files, resume equality, bad input."""
import json
import math
import time

import jax
import numpy as np
import pytest

from rl.config import load_config
from rl.rundir import Checkpoints
from rl.train import main
from rl.trainer import Trainer

BASE = ["--preset", "test", "--encoder", "none", "--total-timesteps", str(8 * 8 * 4), "--checkpoint-every", "2",
        "--quiet"]
WALL_CLOCK = {"sps", "seconds", "llm_time_share", "first_call_includes_compile"}


def _final_state(run_dir):
    cfg = load_config(run_dir / "config.json")
    target = Trainer.from_config(cfg).init_state()
    ckpt = Checkpoints(run_dir)
    step = ckpt.latest_step()
    state = ckpt.restore(target, step)
    ckpt.close()
    return step, state


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(ref_dir, run_dir, updates: int) -> None:
    """Both runs end at `updates` with bit-identical states and the same metrics apart from wall-clock fields."""
    (step_a, a), (step_b, b) = _final_state(ref_dir), _final_state(run_dir)
    assert step_a == step_b == updates
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    strip = lambda r: {k: v for k, v in r.items() if k not in WALL_CLOCK}
    assert [strip(r) for r in _metrics(ref_dir)] == [strip(r) for r in _metrics(run_dir)]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rl") / "full"
    assert main(BASE + ["--run-dir", str(run_dir)]) == 0
    return run_dir


def test_run_dir_files_are_sane(full_run):
    cfg = load_config(full_run / "config.json")
    assert cfg.encoder == "none" and cfg.num_updates == 4 and cfg.run_dir == str(full_run)
    rows = _metrics(full_run)
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert [r["timestep"] for r in rows] == [64, 128, 192, 256]
    for r in rows:
        assert r["sps"] > 0 and math.isfinite(r["total_loss"]) and 0 < r["entropy"] <= math.log(17) + 1e-5
        assert set(r["achievements"]) >= {"collect_wood", "eat_cow"}
        assert "episode_return" in r and "episode_length" in r
    step, state = _final_state(full_run)
    assert step == 4 and int(state.update) == 4
    assert sorted(int(p.name) for p in (full_run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]


def test_resume_after_kill_equals_uninterrupted(full_run, tmp_path):
    run_dir = tmp_path / "killed"
    # Stop after 3 updates (checkpoint at 2 and, because it stops, at 3), then delete checkpoint 3: this is
    # a run killed after update 3 was logged but before it was checkpointed.
    assert main(BASE + ["--run-dir", str(run_dir), "--max-updates", "3"]) == 0
    assert len(_metrics(run_dir)) == 3
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "3")
    assert main(["--resume", str(run_dir), "--quiet"]) == 0

    assert [r["update"] for r in _metrics(run_dir)] == [1, 2, 3, 4]
    _assert_same_run(full_run, run_dir, 4)


def test_resume_of_finished_run_exits_zero(full_run, capsys):
    assert main(["--resume", str(full_run)]) == 0
    assert "already finished" in capsys.readouterr().out


def test_run_dir_with_other_config_is_refused(full_run, capsys):
    assert main(BASE + ["--run-dir", str(full_run), "--seed", "7"]) == 1
    err = capsys.readouterr().err
    assert "another run's config" in err and "seed" in err


def test_resume_accepts_template_assembly(full_run, capsys):
    """Which kernels build the ids does not change them, so a resume may switch (e.g. off a broken Triton)."""
    assert main(["--resume", str(full_run), "--template-assembly", "jnp"]) == 0
    assert "already finished" in capsys.readouterr().out


def test_resume_refuses_extra_flags(full_run, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--resume", str(full_run), "--seed", "3"])
    assert e.value.code == 2 and "--seed" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--env", "Craftax-Nope-v1"), ("--encoder", "bert"),
                                        ("--obs-format", "poetry"), ("--template-assembly", "triton")])
def test_unknown_choice_lists_choices(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice" in err and value in err


def test_underscore_spelling_accepted(tmp_path):
    from rl.train import build_parser, resolve_config

    cfg = resolve_config(build_parser().parse_args(["--num_envs", "16", "--skip_n", "4", "--encoder", "inscan"]))
    assert cfg.num_envs == 16 and cfg.skip_n == 4


def test_skip_n_not_dividing_num_steps_is_an_error_only_for_vllm(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--encoder", "vllm", "--num-steps", "64", "--skip-n", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--skip-n 3 must divide --num-steps 64" in err
    from rl.config import TrainConfig

    assert TrainConfig(encoder="inscan", num_steps=64, skip_n=100).validate().hidden_on_reset == "pool"
    assert TrainConfig(encoder="inscan", skip_n=0).validate().hidden_on_reset == "zero"
    with pytest.raises(ValueError, match="--reset-hidden pool needs --encoder inscan and --skip-n >= 1"):
        TrainConfig(encoder="inscan", skip_n=0, reset_hidden="pool").validate()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    """A NaN loss at update 3 (injected into the real update's metrics): stop, keep checkpoint 2."""
    calls = []
    real_dispatch = Trainer.dispatch

    def dispatch(self, runner, llm_args=(None, None), on_rollout=None):
        runner, metrics = real_dispatch(self, runner, llm_args, on_rollout)
        calls.append(1)
        if len(calls) == 3:
            metrics = dict(metrics, total_loss=np.float32("nan"))
        return runner, metrics

    monkeypatch.setattr(Trainer, "dispatch", dispatch)
    run_dir = tmp_path / "nan"
    assert main(BASE + ["--run-dir", str(run_dir)]) == 1
    assert "loss is nan at update 3" in capsys.readouterr().err
    ckpt = Checkpoints(run_dir)
    assert ckpt.latest_step() == 2  # the last good state, never the NaN one
    ckpt.close()
    assert [r["update"] for r in _metrics(run_dir)] == [1, 2]


def test_unreachable_vllm_url_fails_fast_naming_it(tmp_path, capsys):
    url = "http://127.0.0.1:9"  # discard port: nothing listens there
    t0 = time.monotonic()
    rc = main(BASE + ["--encoder", "vllm", "--vllm-url", url,
                      "--vllm-timeout", "5", "--run-dir", str(tmp_path / "v")])
    assert rc == 1 and time.monotonic() - t0 < 60
    assert url in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the kernel runs natively on a GPU")
def test_pallas_template_off_gpu_is_refused_before_the_run_dir(tmp_path, capsys):
    rc = main(BASE + ["--encoder", "inscan", "--template-assembly", "pallas", "--run-dir", str(tmp_path / "p")])
    assert rc == 1 and "--template-assembly pallas needs a GPU" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_eval_and_plot(full_run, capsys):
    from rl.eval import main as eval_main
    from rl.plot import main as plot_main

    assert eval_main([str(full_run), "--episodes", "4", "--max-steps", "16"]) == 0
    results = json.loads((full_run / "eval.json").read_text())
    assert set(results) == {"real"} and results["real"]["episodes"] == 4
    assert results["real"]["length_mean"] <= 16
    out = full_run / "curves.png"
    assert plot_main([str(full_run), str(full_run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_after_sigkill_equals_uninterrupted(tmp_path):
    """A real kill: a `python -m rl.train` process is SIGKILLed as soon as its first checkpoint is on disk (possibly
    while it writes the next one), resumed in process, and must end exactly like an uninterrupted run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    args = ["--preset", "test", "--encoder", "none", "--total-timesteps", str(8 * 8 * 24), "--checkpoint-every", "2",
            "--quiet"]
    ref = tmp_path / "ref"
    assert main(args + ["--run-dir", str(ref)]) == 0  # also fills the compilation cache for the subprocess

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo), JAX_COMPILATION_CACHE_DIR=str(jax.config.jax_compilation_cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    killed = tmp_path / "killed"
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rl.train", *args, "--run-dir", str(killed)], cwd=repo,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    ckpts = killed / "checkpoints"
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
            break
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()), (
        f"the run never wrote a checkpoint (exit code {proc.returncode}):\n{log.read_text()[-3000:]}")

    assert main(["--resume", str(killed), "--quiet"]) == 0
    _assert_same_run(ref, killed, 24)


# ------------------------------------------------------------------ reliability of the run directory (issue 18)
def _copy_run(src, dst, drop_checkpoints=()):
    import shutil

    shutil.copytree(src, dst)
    for step in drop_checkpoints:
        shutil.rmtree(dst / "checkpoints" / str(step))
    return dst


def test_metrics_log_skips_and_reports_bad_lines(tmp_path):
    from rl.rundir import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"update": 1}\n{"upda\n\n[3]\n{"update": 4}\n{"update": 5, "x": 1')
    reports = []
    log = MetricsLog(path, report=reports.append)
    assert [r["update"] for r in log.read()] == [1, 4]
    assert len(reports) == 1 and "skipped 3 unreadable line(s) (line 2, 4, 6)" in reports[0]
    log.truncate_after(4)
    assert path.read_text() == '{"update": 1}\n{"update": 4}\n'
    from rl.rundir import RunDirError

    with pytest.raises(RunDirError, match="cannot append to"):
        MetricsLog(tmp_path / "no-such-dir" / "metrics.jsonl").append({"update": 1})


def test_unwritable_run_dir_is_refused_in_one_line_before_any_work(full_run, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(BASE + ["--run-dir", str(blocker / "run")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot create the run directory {blocker / 'run'}" in err
    # A run directory whose checkpoints/ cannot be written (a file where the directory should be: root too).
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    (run_dir / "config.json").write_text((full_run / "config.json").read_text())
    (run_dir / "checkpoints").write_text("")
    assert main(["--resume", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write to {run_dir / 'checkpoints'}" in err


def test_truncated_newest_checkpoint_resumes_from_the_previous_one(full_run, tmp_path, capsys):
    """A finished run whose newest checkpoint is damaged: --resume verifies it, sets it aside, restores the
    previous one and ends exactly like the uninterrupted run."""
    run_dir = _copy_run(full_run, tmp_path / "damaged")
    for f in (run_dir / "checkpoints" / "4").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert main(["--resume", str(run_dir), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint 4" in err and "does not restore" in err and "set aside" in err
    assert [p.name.split("-")[0] for p in (run_dir / "unreadable_checkpoints").iterdir()] == ["4"]
    _assert_same_run(full_run, run_dir, 4)


def test_no_restorable_checkpoint_is_one_line(full_run, tmp_path, capsys):
    run_dir = _copy_run(full_run, tmp_path / "all-damaged")
    for f in (run_dir / "checkpoints").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"")
    assert main(["--resume", str(run_dir), "--quiet"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: no checkpoint in") and "restores: 4: " in last and "; 2: " in last


def test_failed_checkpoint_save_stops_the_run_at_once(full_run, tmp_path):
    """A full disk (RLIMIT_FSIZE: a limit root cannot bypass) while checkpoint 4 is written: the process exits
    non-zero with one line within seconds of the failure, and checkpoint 2 is still the newest and restores."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    run_dir = _copy_run(full_run, tmp_path / "full-disk", drop_checkpoints=[4])
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo), JAX_COMPILATION_CACHE_DIR=str(jax.config.jax_compilation_cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")

    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, 16_000)); "
               "sys.argv[0] = 'rl.train'; runpy.run_module('rl.train', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", limited, "--resume", str(run_dir), "--quiet"], cwd=repo, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    failed_at, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if failed_at is None and "cannot write checkpoint 4" in line:
            failed_at = time.monotonic()
    proc.wait(timeout=300)
    assert failed_at is not None, "".join(lines)[-3000:]
    assert time.monotonic() - failed_at < 30 and proc.returncode == 1
    assert "Traceback" not in "".join(lines) and "checkpoint 2 is intact" in "".join(lines)
    ckpt = Checkpoints(run_dir)
    assert ckpt.all_steps() == [2]
    ckpt.close()
    cfg = load_config(run_dir / "config.json")
    restored = Checkpoints(run_dir).restore(Trainer.from_config(cfg).init_state(), 2)
    original = Checkpoints(full_run).restore(Trainer.from_config(cfg).init_state(), 2)
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(original)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_update_compiled_ahead_is_not_compiled_again():
    """issue 35: `Trainer.compile_update` (run in a thread by rl.train while the run sets up) compiles the program
    that the update's first call then runs: no backend compile happens at that call, and its result equals an
    update of a trainer that compiled on its first call."""
    from rl.config import PRESETS, TrainConfig
    from rl.encoder_kinds import load_encoder
    from rl.llm import LLMArgs

    cfg = TrainConfig(**PRESETS["test"], encoder="none")

    def trainer():
        return Trainer(cfg.envs, cfg.ppo, load_encoder(cfg.hidden, cfg.llm, cfg.env), devices=1)

    ahead, plain = trainer(), trainer()
    assert ahead.runs_update
    ahead.compile_update(LLMArgs())
    state = ahead.init_state(LLMArgs())
    plain_state = plain.init_state(LLMArgs())

    def compiles_of(update, runner):
        """(the update's results, the backend compiles its call ran)"""
        seen = []
        listener = lambda name, seconds, **kw: seen.append(name) if "backend_compile" in name else None  # noqa: E731
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            return jax.device_get(update(runner, LLMArgs())), seen
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)

    got, compiled = compiles_of(ahead.update, state)
    want, compiled_plain = compiles_of(plain.update, plain_state)
    assert compiled == [] and compiled_plain  # the listener sees a first call's compile
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_first_encode_compiled_ahead_from_the_llm_shapes_is_not_compiled_again():
    """issue 35: `Trainer.compile_start` and `compile_reset` compile the first states' LLM call and the env reset
    from the LLM's shapes (`load_encoder(..., weights=False)`: nothing loaded yet); after `load_weights`,
    `init_state` compiles none of those programs again and its state equals that of a trainer built on the loaded LLM (bit for bit)."""
    from rl.config import PRESETS, TrainConfig
    from rl.encoder_kinds import load_encoder

    cfg = TrainConfig(**{**PRESETS["test"], "encoder": "inscan", "model": "tiny"})
    encoder = load_encoder(cfg.hidden, cfg.llm, cfg.env, weights=False)
    assert encoder.weights_pending
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(encoder.jit_args()))
    ahead = Trainer(cfg.envs, cfg.ppo, encoder, devices=1)
    compiled = {"ahead": [], "load": [], "init": []}
    phase = ["ahead"]
    listener = lambda name, seconds, fun_name="", **kw: (  # noqa: E731
        compiled[phase[0]].append(fun_name) if "backend_compile" in name else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        ahead.compile_start(encoder.jit_args())
        ahead.compile_reset()
        phase[0] = "load"
        encoder.load_weights()
        assert not encoder.weights_pending
        phase[0] = "init"
        state = jax.device_get(ahead.init_state(ahead.place_llm_args(encoder.jit_args())))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    programs = [name for name in compiled["ahead"] if "lambda" in name]  # the shard_maps (eager ops aside)
    assert len(programs) == 2 and not set(programs) & set(compiled["init"])
    loaded = load_encoder(cfg.hidden, cfg.llm, cfg.env)
    plain = Trainer(cfg.envs, cfg.ppo, loaded, devices=1)
    want = jax.device_get(plain.init_state(plain.place_llm_args(loaded.jit_args())))
    jax.tree.map(np.testing.assert_array_equal, state, want)


def test_programs_compile_while_the_llm_weights_load(tmp_path, monkeypatch, capsys):
    """issue 35: rl.train starts compiling the update and the first states' LLM call (from the LLM's shapes) before
    it loads the weights, so a slow load overlaps them: the load here waits until both compiles have started. The
    run's metrics equal those of a run that loads the weights first (the order of old)."""
    import threading

    import rl.encoder_kinds as kinds

    started = {"update": threading.Event(), "first encode": threading.Event()}
    seen = {}
    real_update, real_start, real_load = Trainer.compile_update, Trainer.compile_start, kinds.load_weights

    def compile_update(self, *a, **kw):
        started["update"].set()
        return real_update(self, *a, **kw)

    def compile_start(self, *a, **kw):
        started["first encode"].set()
        return real_start(self, *a, **kw)

    def slow_load(*a):
        seen.update({name: event.wait(120) for name, event in started.items()})
        return real_load(*a)

    monkeypatch.setattr(Trainer, "compile_update", compile_update)
    monkeypatch.setattr(Trainer, "compile_start", compile_start)
    monkeypatch.setattr(kinds, "load_weights", slow_load)
    args = ["--preset", "test", "--encoder", "inscan", "--model", "tiny", "--checkpoint-every", "100"]
    assert main(args + ["--run-dir", str(tmp_path / "overlapped")]) == 0
    assert seen == {"update": True, "first encode": True}
    err = capsys.readouterr().err
    assert err.index("compiling the update in the background") < err.index("loading the LLM's weights (tiny")
    assert err.index("loading the LLM's weights (tiny") < err.index("LLM: tiny (")

    monkeypatch.setattr(kinds.InScanEncoder, "loads_weights_later", False)  # the weights first, as before
    assert main(args + ["--run-dir", str(tmp_path / "loaded_first")]) == 0
    assert "loading the LLM (tiny) and its tokenizer" in capsys.readouterr().err
    drop = {"sps", "seconds", "llm_time_share", "first_call_includes_compile"}
    rows = [[{k: v for k, v in r.items() if k not in drop} for r in _metrics(tmp_path / name)]
            for name in ("overlapped", "loaded_first")]
    assert rows[0] == rows[1] and len(rows[0]) == 3
