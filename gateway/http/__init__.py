"""The HTTP surface: routes, the one body reader, who may reach the operator surfaces, the admin API."""
