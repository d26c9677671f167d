"""Runnable processes beside the HTTP workers."""
