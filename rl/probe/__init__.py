"""`python -m rl.probe RUN_DIR [RUN_B]`: what the LLM state does to a trained agent.

Counterfactual pairs built from real game states (`pairs`: the edit table), prompt-only edits (`prompts`), every
hidden-state mode (`forward`), statistics and value diagnostics (`metrics`), outputs (`report`). The one function
that reads a run directory is `rl.probe.policy.load_policy`.
"""
