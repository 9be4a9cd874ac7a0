"""Hosted model APIs as upstreams: chat completions translated to and from each provider's wire format.

One codec per provider (`anthropic`, `bedrock`, `gemini`, `azure_openai`), all pure functions of
plain dicts and bytes like `backends.protocols`: the gateway's transport for a hosted pool asks its
codec for the call to make and for the chat-shaped answer, so every front API the gateway serves
(chat completions, Responses, Messages, batch lines) reaches every provider through one pivot.
"""
