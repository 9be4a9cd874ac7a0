"""The web console at /ui: committed static pages over the admin API, behind the admin token."""
