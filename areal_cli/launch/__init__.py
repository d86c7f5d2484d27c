"""Launch plans (pure) and the runners that execute them."""
