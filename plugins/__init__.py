"""Built-in clipkit plugins (installed as ``clipkit.plugins``)."""
