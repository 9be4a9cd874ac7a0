"""The predictor room: how long would this request take on that endpoint (docs/architecture.md).

`service.LatencyPredictor` is the facade the gateway holds; `types` is the vocabulary (feature
layout, `RequestShape`, `Prediction`); `config.PredictorSettings` is gateway.yaml's `predictor:`.
Inside: `features` (one row per candidate), `prior` (the sim's roofline as an analytic prior),
`rates` (recent prefill load per endpoint), `model` (XGBoost regressors on the log-ratio over the
prior), `forest` (those trees compiled to numpy for the hot path), `buffers` (stratified training
samples), `trainer` (retraining off the event loop), `persist` (versioned models on disk),
`accuracy` (online MAPE and p90 coverage), `length` (output-length estimates).

Imports only `backends` (read-only state types and the sim's performance model).
"""
