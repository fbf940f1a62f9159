"""Helpers shared by several test folders; each module's docstring says what it starts or forges."""
