"""Microsoft Entra ID bearer tokens for Azure OpenAI pools (`auth: entra`).

Azure OpenAI accepts `Authorization: Bearer TOKEN` with a token for the Cognitive Services scope
instead of an `api-key` (Microsoft Learn, "How to configure Azure OpenAI in Azure AI Foundry Models
with Microsoft Entra ID authentication"). The token comes from azure-identity's
`DefaultAzureCredential` (environment, workload identity, managed identity, Azure CLI, ...): its
`get_token` may block on a token endpoint or a subprocess, so the transport calls `refresh` off the
event loop at start-up and again before the token's expiry, never per request, as it does for
Bedrock's and Vertex AI's credentials. azure-identity is optional (`pip install 'tokenway[azure]'`),
imported on first use. Any object with azure-core's `get_token(*scopes)` returning an `AccessToken`
(`token`, `expires_on` in epoch seconds) may stand in for the default credential.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

SCOPE: Final = "https://cognitiveservices.azure.com/.default"


class TokenCredential(Protocol):
    """azure-core's `TokenCredential`, as far as it is used here."""

    def get_token(self, *scopes: str, **kwargs: Any) -> Any: ...


class EntraToken:
    """One pool endpoint's Entra ID token source; `refresh` blocks (run it off the loop)."""

    def __init__(self, credential: TokenCredential | None = None) -> None:
        self._credential = credential

    def refresh(self) -> tuple[str, float]:
        """(access token, its expiry in epoch seconds) for the Cognitive Services scope."""
        if self._credential is None:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as exc:  # pragma: no cover - depends on the install
                raise RuntimeError("`auth: entra` needs azure-identity: pip install 'tokenway[azure]'") from exc
            self._credential = DefaultAzureCredential()
        token = self._credential.get_token(SCOPE)
        return str(token.token), float(token.expires_on)

    @staticmethod
    def headers(token: str) -> dict[str, str]:
        return {"authorization": f"Bearer {token}"}
