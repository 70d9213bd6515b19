"""Episode videos of a trained policy: Craftax's pixel view of each step beside the text the LLM read.

The policy plays exactly as in training (the trainer's own window scan; for LLM runs the hidden state is
refreshed from the window's first state every skip_n steps), one env per recorded episode. Each frame shows the
game (Craftax's pixel renderer) and, on the right, the observation part of the prompt of the current window (the
constant prompt head before it is left out); runs without an LLM show the same text of the current state, for
reading along. GIF needs only Pillow; MP4 needs imageio's ffmpeg plugin (`pip install imageio-ffmpeg`).
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl.jit import compile_program

PANEL_WIDTH = 560  # pixels of the text panel
FRAME_HEIGHT = 480  # pixels of the game view after scaling
FONT_SIZE = 15


def _pixel_renderer(env_name: str):
    """A jitted [T] batch of raw craftax states -> uint8 [T, H, W, 3] with the upstream renderer of `env_name`
    (`render.envs.ENVS` names it; night noise off where the renderer has it)."""
    import importlib

    from render.envs import check_env_name

    env = check_env_name(env_name)
    block_pixels = importlib.import_module(env.constants).BLOCK_PIXEL_SIZE_IMG
    options = {"do_night_noise": False} if env.night_noise else {}
    render = importlib.import_module(env.renderer).make_craftax_pixel_renderer(block_pixels, **options)
    return compile_program(lambda states: jnp.clip(jax.vmap(render)(states), 0, 255).astype(jnp.uint8),
                           runs_llm=False)


def _font():
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=FONT_SIZE)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def compose_frame(pixels: np.ndarray, text: str, caption: str, font=None) -> np.ndarray:
    """One video frame: the game view scaled to FRAME_HEIGHT (nearest neighbour) beside `text` (wrapped,
    cut with '...' when it does not fit) under a one-line `caption`."""
    from PIL import Image, ImageDraw

    font = font or _font()
    game = Image.fromarray(pixels)
    scale = FRAME_HEIGHT / game.height
    game = game.resize((max(1, round(game.width * scale)), FRAME_HEIGHT), Image.NEAREST)
    frame = Image.new("RGB", (game.width + PANEL_WIDTH, FRAME_HEIGHT), (250, 250, 245))
    frame.paste(game, (0, 0))
    draw = ImageDraw.Draw(frame)
    line_h = FONT_SIZE + 3
    chars = max(20, (PANEL_WIDTH - 20) * 2 // FONT_SIZE)  # about half a font size per character
    lines = [caption, ""] + [w for ln in text.splitlines() for w in (textwrap.wrap(ln, chars) or [""])]
    fit = (FRAME_HEIGHT - 16) // line_h
    if len(lines) > fit:
        lines = lines[:fit - 1] + ["..."]
    for i, ln in enumerate(lines):
        draw.text((game.width + 10, 8 + i * line_h), ln, fill=(0, 0, 120) if i == 0 else (20, 20, 20), font=font)
    return np.asarray(frame)


def check_video_path(out: Path) -> None:
    """Raise ValueError (one line) for a file type that cannot be written here, before any episode is played."""
    import importlib.util

    suffix = Path(out).suffix.lower()
    if suffix not in (".gif", ".mp4"):
        raise ValueError(f"--video {out}: the file name must end in .gif or .mp4")
    if suffix == ".mp4" and not all(importlib.util.find_spec(m) for m in ("imageio", "imageio_ffmpeg")):
        raise ValueError(f"--video {out}: MP4 needs imageio and its ffmpeg plugin (pip install imageio "
                         f"imageio-ffmpeg), or write a .gif")


def write_video(frames: list[np.ndarray], out: Path, fps: float) -> Path:
    """Frames to `out`: .gif with Pillow, .mp4 through imageio's ffmpeg plugin (one-line error when missing)."""
    out = Path(out)
    check_video_path(out)
    suffix = out.suffix.lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".gif":
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        images[0].save(out, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
        return out
    try:
        import imageio.v2 as imageio

        writer = imageio.get_writer(out, fps=fps, macro_block_size=8)
    except Exception as e:  # noqa: BLE001 - no ffmpeg backend, raised as different types by imageio versions
        raise ValueError(f"--video {out}: MP4 needs imageio's ffmpeg plugin (pip install imageio-ffmpeg; "
                         f"{type(e).__name__}), or write a .gif") from None
    with writer:
        for f in frames:
            writer.append_data(f)
    return out


def record_video(policy: Any, out: Path, *, episodes: int = 1, seed: int = 1234, max_steps: int = 300,
                 fps: float = 6.0, say=lambda text: None) -> Path:
    """Play `episodes` episodes (one env each, one after the other in the video) with a restored run's policy
    (`rl.runs.restore_policy(run_dir, purpose="record")`: a `RunPolicy`) and write them to `out` (.gif or .mp4).
    Each env's video ends with its first episode, or after `max_steps` steps."""
    check_video_path(out)
    n = episodes
    say(f"recording {n} episode{'s' if n > 1 else ''} of update {policy.step}'s policy (up to {max_steps} steps "
        f"each) ...")
    frames = [f for env_frames in play_frames(policy, n, seed, max_steps) for f in env_frames]
    write_video(frames, out, fps)
    say(f"wrote {out} ({len(frames)} frames at {fps:g} fps)")
    return Path(out)


def play_frames(policy: Any, n: int, seed: int, max_steps: int) -> list[list[np.ndarray]]:
    """Each of `n` envs' frames (`compose_frame`) while `policy` (`rl.runs.RunPolicy`) plays: the one play loop
    (`rl.play`) on the trainer's own scan, the hidden state refreshed from the window's first states every skip_n
    steps (0: once) and never ablated, so the play's keys are those of training. An env's frames end with its
    first episode, or after `max_steps` steps."""
    from rl.play import no_episodes, play_windows, trainer_start, trainer_window

    cfg, trainer, llm = policy.cfg, policy.trainer, policy.llm
    env = trainer.env
    window = (cfg.skip_n or max_steps) if llm is not None else 16
    run_window = trainer_window(trainer, policy.encode, record=lambda carry, steps: (steps.states, steps.info))
    render = _pixel_renderer(cfg.env)
    obs_text = _observation_text(cfg, llm)
    font = _font()
    per_env: list[list[np.ndarray]] = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    played = [0]  # steps before the current window

    def add_frames(window_out) -> None:
        states, info = window_out
        t = played[0]
        first = jax.tree.map(lambda x: x[0], states)  # the window's first states: what the LLM read
        texts = [obs_text(jax.tree.map(lambda x: x[i], first)) for i in range(n)]
        pixels = np.asarray(jax.vmap(render, in_axes=1, out_axes=1)(states))  # [T, B, H, W, 3]
        ended = np.asarray(info.episode_length > 0)
        for k in range(min(window, max_steps - t)):
            for i in np.flatnonzero(~done):
                caption = f"episode {i + 1}, step {t + k + 1}" + (
                    f"; the LLM read this at step {t + 1} (every {window} steps)" if llm is not None else "")
                per_env[i].append(compose_frame(pixels[k, i], texts[i], caption, font))
                if ended[k, i]:
                    done[i] = True
        played[0] += window

    step = lambda carry, seen, length: run_window(carry, seen, policy.params, None, policy.llm_args,  # noqa: E731
                                                  length=length, keep=True)
    play_windows(step, trainer_start(trainer, n)(seed), no_episodes(n, len(env.achievement_names)), max_steps,
                 window, on_window=add_frames)
    return per_env


def _observation_text(cfg: Any, llm: Any):
    """raw state (one env) -> the text shown beside it: the prompt's observation part for LLM runs (what
    follows the constant head), the compact rendering otherwise."""
    if llm is not None:
        head = len(llm.template.prefix_ids)
        return lambda s: (f"[prompt head: {head} tokens, cached]\n" + llm.template.observation_text(s)).rstrip()
    from render import render_text

    return lambda s: "(no LLM in this run; the state as text)\n" + render_text(s, cfg.env, "compact")
