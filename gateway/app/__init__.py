"""The application and its CLI: the app factory, the process (server), gateway.yaml, cross-file checks."""
