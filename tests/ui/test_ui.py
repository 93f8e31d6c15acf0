#!/usr/bin/env python3
"""Headless-browser test of the chat page that `mlxcel serve` bundles at `/`.

Needs a running server (MLXCEL_UI_URL, e.g. http://127.0.0.1:8080), Debian's
/usr/bin/chromium and /usr/bin/chromedriver, and selenium 4. tests/ui/run.sh
starts a server and runs this. Writes a screenshot to MLXCEL_UI_SCREENSHOT if set.
"""
import os
import re
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

READY_TIMEOUT_S = float(os.environ.get("MLXCEL_UI_READY_TIMEOUT", 60))  # the model may still be loading
REPLY_TIMEOUT_S = 120


def start_browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def text(driver, element_id):
    return driver.find_element(By.ID, element_id).text.strip()


def wait_until(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")


def wait_for_status(driver, wanted, timeout_s):
    def reached():
        status = text(driver, "status")
        assert not status.startswith("error"), f"#status shows {status!r} while waiting for {wanted!r}"
        return status == wanted

    wait_until(reached, timeout_s, lambda: f"#status to read {wanted!r} (it reads {text(driver, 'status')!r})")


def set_field(driver, element_id, value):
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def open_settings(driver):
    details = driver.find_element(By.TAG_NAME, "details")
    if not details.get_attribute("open"):
        details.find_element(By.TAG_NAME, "summary").click()


def send(driver, prompt):
    driver.find_element(By.ID, "input").send_keys(prompt)
    driver.find_element(By.ID, "send").click()


def messages(driver, role):
    return driver.find_elements(By.CSS_SELECTOR, f"#messages .msg.{role}")


def check_ready(driver):
    wait_for_status(driver, "ready", READY_TIMEOUT_S)
    assert text(driver, "model-name"), "#model-name is empty"
    ctx = text(driver, "ctx-size")
    assert ctx.isdigit() and int(ctx) > 0, f"#ctx-size should be a positive integer, got {ctx!r}"


def check_reply(driver):
    open_settings(driver)
    set_field(driver, "temperature", 0)
    set_field(driver, "max_tokens", 24)
    send(driver, "Name three colors.")
    wait_for_status(driver, "done", REPLY_TIMEOUT_S)

    users, assistants = messages(driver, "user"), messages(driver, "assistant")
    assert len(users) == 1, f"expected one user message, found {len(users)}"
    assert len(assistants) == 1, f"expected one assistant message, found {len(assistants)}"
    assert users[0].text.strip() == "Name three colors.", f"user message reads {users[0].text!r}"
    assert assistants[0].text.strip(), "the assistant message is empty"

    tps = text(driver, "tps")
    speed = re.search(r"\d+(?:\.\d+)?", tps)
    assert speed and float(speed.group()) > 0, f"#tps should show a speed > 0, got {tps!r}"
    print(f"reply: {assistants[0].text.strip()!r} at {tps}")


def check_stop(driver):
    # A fresh conversation, so the reply is the long count and not a short
    # answer shaped by the first exchange.
    driver.find_element(By.ID, "new-chat").click()
    set_field(driver, "max_tokens", 2000)
    send(driver, "Count from 1 to 1000, one number per line.")
    stop = driver.find_element(By.ID, "stop")
    wait_until(lambda: len(messages(driver, "assistant")) == 1 and messages(driver, "assistant")[-1].text.strip(),
               REPLY_TIMEOUT_S, "the second reply's first text")
    status = text(driver, "status")
    assert status == "generating", f"#status should read 'generating' mid-reply, got {status!r}"
    assert stop.is_enabled(), "#stop should be enabled while generating"
    stop.click()
    wait_for_status(driver, "stopped", 10)
    assert not stop.is_enabled(), "#stop should be disabled once stopped"


def check_new_chat(driver):
    driver.find_element(By.ID, "new-chat").click()
    wait_until(lambda: not driver.find_elements(By.CSS_SELECTOR, "#messages .msg"), 5, "#messages to empty")


def print_diagnostics(driver):
    try:
        print(f"#status: {text(driver, 'status')!r}", file=sys.stderr)
        for entry in driver.get_log("browser"):
            print(f"console: {entry['level']} {entry['message']}", file=sys.stderr)
    except Exception as err:  # the browser itself may be gone
        print(f"(no diagnostics: {err})", file=sys.stderr)


def main():
    url = os.environ.get("MLXCEL_UI_URL")
    assert url, "set MLXCEL_UI_URL to the server's base URL, e.g. http://127.0.0.1:8080"
    screenshot = os.environ.get("MLXCEL_UI_SCREENSHOT")
    driver = start_browser()
    try:
        driver.get(url.rstrip("/") + "/")
        check_ready(driver)
        check_reply(driver)
        if screenshot:
            os.makedirs(os.path.dirname(os.path.abspath(screenshot)), exist_ok=True)
            assert driver.save_screenshot(screenshot), f"could not write {screenshot}"
            print(f"screenshot: {screenshot}")
        check_stop(driver)
        check_new_chat(driver)
    except Exception:
        print_diagnostics(driver)
        raise
    finally:
        driver.quit()
    print("web UI test passed")


if __name__ == "__main__":
    main()
