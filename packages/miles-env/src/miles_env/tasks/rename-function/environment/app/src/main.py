from users.api import fetch_usr
from users.legacy import fetch_usr_legacy


def main():
    print(fetch_usr(1)["name"])
    print(fetch_usr_legacy(2)["name"])


if __name__ == "__main__":
    main()
