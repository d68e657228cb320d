"""Built-in recipes (YAML), installed as package data of ``clipkit.recipes``."""
