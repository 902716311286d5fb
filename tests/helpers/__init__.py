"""Test helpers shared by the integration and e2e tests (not a test module)."""
