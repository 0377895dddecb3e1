"""STAR's remaining-length predictor (paper 003, §4): record hidden states, train the MLP, evaluate it, and
predict in the agent.

Modules: `shards` (the labelled-sample files and their reader), `recorder` (the agent-side recorder behind
`--record-hidden-states`), `mlp` (Eq. 2's network, its gradients and AdamW), `training` (request-level
split, early stopping, the §4.4 search), `predictor` (`LengthPredictor`: the saved file and `predict`),
`evaluate` (MAE per method and per generated-token bucket), `collect` (replaying a dataset through agents that
record), `cli` (`switchyard predictor collect|train|eval`) and `live` (the agent's prediction rounds behind
`--length-predictor FILE|oracle` and `--star-report`: N(r), N-hat(r) and the H-round future load pushed on
`WatchState`).
"""
