"""Roles and grants, tenants, sealed values, redaction and its catalogue."""
