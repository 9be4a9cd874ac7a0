"""Endpoints a pool finds at run time instead of listing them: Kubernetes EndpointSlices.

`config` is importable everywhere (gateway.yaml's schema); `kubernetes` needs the optional
`kubernetes` client (`pip install 'tokenway[k8s]'`) and is imported only when a pool asks for
discovery, so the gateway runs without it.
"""
