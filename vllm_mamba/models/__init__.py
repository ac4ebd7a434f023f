"""Model implementations and the registry that maps architecture names to them."""
