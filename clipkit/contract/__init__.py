"""The plugin contract: the hooks (hookspecs), the one plugin manager, the name tables
(registry), the types every plugin speaks (types) and the contract checks for plugin authors (testing).
"""
