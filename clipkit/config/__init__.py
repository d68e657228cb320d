"""Configuration: recipes (recipe), every host setting with its type, default and range
(settings_schema, constraints), and fitting settings to this machine (machine).
"""
