"""Tamper evidence anchored outside the database, and the task timeline."""
