"""How far the gateway's prompt-token estimate for a hosted model is from the provider's own count."""
