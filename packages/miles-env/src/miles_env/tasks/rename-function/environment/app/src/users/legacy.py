from users.store import USERS


def fetch_usr_legacy(user_id):
    return dict(USERS[user_id], legacy=True)
