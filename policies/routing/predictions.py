"""Where a request's latency predictions live while it is routed.

The latency scorer predicts every candidate in one batched call and leaves the predictions in
`facts.attrs[PREDICTIONS_ATTR]` (endpoint id -> `predictor.types.Prediction`), so the gateway reuses
the serving endpoint's prediction as the training sample's features instead of predicting twice.
"""

PREDICTIONS_ATTR = "_predictions_by_endpoint"
