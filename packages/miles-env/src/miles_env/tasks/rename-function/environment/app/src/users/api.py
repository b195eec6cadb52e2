from users.store import USERS


def fetch_usr(user_id):
    """Look a user up by id (see docs: 'fetch_usr' is the old name)."""
    return USERS[user_id]


def fetch_many(ids):
    return [fetch_usr(i) for i in ids]
