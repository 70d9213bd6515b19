"""PPO on Craftax whose policy can read an LLM hidden state (`--encoder none | inscan | vllm`).

CLIs: `python -m rl.train`, `python -m rl.eval DIR`, `python -m rl.plot DIR...`. Library entry points:
`rl.config.TrainConfig`, `rl.trainer.Trainer`, `rl.train.train`, `rl.envs.BatchedEnv`,
`rl.networks.ActorCritic` / `ActorCriticAug`. Design: docs/TRAINING.md.
"""
