"""Built-in policies, one module each; every module here is imported by ``policy.get_policy``."""
