"""Serving: decode caches, generation and export."""
