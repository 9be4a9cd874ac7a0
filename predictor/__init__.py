"""The predictor room: how long would this request take on that endpoint (docs/architecture.md).

`service.LatencyPredictor` is the facade the gateway holds (with the recent-first-token correction
and each endpoint's recent prefill load); `features` is the vocabulary (feature layout,
`RequestShape`, `Prediction`), the rows of one request on its candidates, the stratified training
samples and online accuracy; `config.PredictorSettings` is gateway.yaml's `predictor:`. Inside:
`prior` (the sim's roofline as an analytic prior, token velocity, output-length estimates), `model`
(XGBoost regressors on the log-ratio over the prior, compiled to numpy for the hot path, retrained
off the event loop), `persist` (versioned models on disk).

Imports only `backends` (read-only state types and the sim's performance model).
"""
