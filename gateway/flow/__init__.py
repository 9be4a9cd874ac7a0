"""Flow control's waiting room (the decisions it applies are `policies/flow/`)."""
