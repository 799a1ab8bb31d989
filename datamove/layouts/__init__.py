"""datamove layouts stage: layout spaces, the layout graph and configuration selection."""
